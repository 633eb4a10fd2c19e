"""The Docker image is the GPU-tested stack: docker/gpu_stack.txt states the torch, CUDA,
Triton, transformers and DeepSpeed versions the GPU checks last ran with, once; the
Dockerfile's base image and pip constraints are exactly those, within pyproject.toml's
ranges; the image's test stage carries what scripts/gpu_check.sh runs; and
scripts/gpu_stack.py compares an environment or a gpu_check.json with the stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest
from cli_runner import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, str(REPO / "scripts"))
import gpu_stack

DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
STACK = gpu_stack.read_stack()
STACK_PACKAGES = ("torch", "triton", "transformers", "deepspeed")  # cuda is torch's build


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    """pyproject.toml's dependencies (or one extra's), as the installed metadata has them."""
    found = {}
    for text in metadata.requires("collage_train") or []:
        requirement = Requirement(text)
        wanted = requirement.marker is None if extra is None else f'extra == "{extra}"' in text
        if wanted:
            found[canonicalize_name(requirement.name)] = requirement
    return found


def constraint_pins() -> dict[str, str]:
    text = (REPO / "docker" / "constraints.txt").read_text()
    return {
        canonicalize_name(name): version
        for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.MULTILINE)
    }


def stages() -> list[tuple[str, str, str]]:
    """(base, stage name, body) for each ``FROM base AS name`` of the Dockerfile."""
    parts = re.split(r"^FROM (\S+) AS (\S+)\n", DOCKERFILE, flags=re.MULTILINE)
    return [(parts[i], parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)]


def instructions(body: str) -> list[str]:
    """A stage's instructions, continuation lines joined, comments dropped."""
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(i.split()) for i in "\n".join(lines).replace("\\\n", " ").splitlines()]


def test_the_stack_names_each_component_once_and_dates_its_gpu_check():
    text = (REPO / "docker" / "gpu_stack.txt").read_text()
    for name in gpu_stack.COMPONENTS:
        assert len(re.findall(rf"^{name}==", text, re.MULTILINE)) == 1, name
    (checked,) = re.findall(r"^# Last GPU check: (\d{4}-\d\d-\d\d), (.+)$", text, re.MULTILINE)
    assert "GPU" in checked[1] or "NVIDIA" in checked[1]


def test_the_cited_gpu_record_ran_this_torch_cuda_and_triton():
    """Where the stack cites a docs/RESULTS.md section, that section's machine line names
    the same torch build and Triton."""
    text = (REPO / "docker" / "gpu_stack.txt").read_text()
    cited = re.search(r'docs/RESULTS\.md, "([^"]+)"', text)
    if cited is None:
        pytest.skip("the stack cites a gpu_check.json, not docs/RESULTS.md")
    results = (REPO / "docs" / "RESULTS.md").read_text()
    # sections at every heading level: RESULTS.md groups its measures' entries under ###
    (section,) = [s for s in re.split(r"\n#+ ", results) if s.startswith(cited[1])]
    cuda = STACK["cuda"].replace(".", "")
    assert f"torch {STACK['torch']}+cu{cuda}" in section
    assert f"Triton\n{STACK['triton']}" in section or f"Triton {STACK['triton']}" in section


def test_the_base_image_is_the_stacks_torch_and_cuda():
    (runtime, test) = stages()
    assert runtime[:2] == (
        f"pytorch/pytorch:{STACK['torch']}-cuda{STACK['cuda']}-cudnn9-devel",
        "runtime",
    )
    assert test[:2] == ("runtime", "test")  # one external base image
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.MULTILINE)) == 2


def test_the_stack_lies_in_pyprojects_ranges():
    declared, dev = requirements(), requirements("dev")
    for name in ("torch", "transformers", "deepspeed"):
        assert Version(STACK[name]) in declared[name].specifier, (name, str(declared[name]))
    assert Version(STACK["triton"]) in dev["triton"].specifier
    assert Version(STACK["torch"]) >= Version("2.6")  # transformers 5 disables torch below


def test_every_install_is_constrained_to_the_stack_and_checked_against_it():
    """Each pip install of the image reads the stack and the suite's constraints, and the
    same instruction then refuses any other torch, CUDA, Triton, transformers or DeepSpeed."""
    installs = [
        step
        for _, _, body in stages()
        for step in instructions(body)
        if step.startswith("RUN") and "pip install" in step
    ]
    assert len(installs) == 2  # the runtime stage's and the test stage's
    for step in installs:
        assert "--constraint docker/gpu_stack.txt" in step
        assert "--constraint docker/constraints.txt" in step
        assert step.index("pip install") < step.index("&& python scripts/gpu_stack.py")


def test_the_stack_is_stated_once_and_every_other_dependency_pinned():
    pins, declared = constraint_pins(), requirements()
    assert not set(pins) & {*STACK_PACKAGES, "cuda"}, "the stack belongs in gpu_stack.txt"
    for name, version in pins.items():
        requirement = declared.get(name) or requirements("dev").get(name)
        if requirement is not None:
            assert Version(version) in requirement.specifier, (name, version, str(requirement))
    missing = set(declared) - set(pins) - set(STACK_PACKAGES)
    assert not missing, f"declared but pinned nowhere: {sorted(missing)}"


def test_the_test_stage_carries_what_the_gpu_check_runs():
    (_, _, runtime), (_, _, test) = stages()
    copied = {
        source
        for body in (runtime, test)
        for step in instructions(body)
        if step.startswith("COPY")
        for source in step.split()[1:-1]
    }
    for path in ("tests", "scripts", "docs", "docker", "collage_train", "configs"):
        assert path in copied, path
    assert "docker/gpu_stack.txt" in copied and "scripts/gpu_stack.py" in copied  # runtime
    for path in copied:
        assert (REPO / path).exists(), path
    assert any('".[dev]"' in step for step in instructions(test))
    assert 'CMD ["scripts/gpu_check.sh"]' in instructions(test)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not {"tests", "scripts", "docs", "docker"} & set(ignored)
    assert {".git", ".venv"} <= set(ignored)


def _check(*args: str) -> subprocess.CompletedProcess:
    script = REPO / "scripts" / "gpu_stack.py"
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def _gpu_check_json(tmp_path, **changed: str) -> str:
    environment = {
        "gpu": "NVIDIA H100 80GB HBM3",
        "driver": "580.159.04",
        **STACK,
        "torch": f"{STACK['torch']}+cu{STACK['cuda'].replace('.', '')}",  # a CUDA build
        **changed,
    }
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"environment": environment, "steps": []}))
    return str(path)


def test_a_gpu_check_of_the_stack_passes_and_another_is_one_error_line(tmp_path):
    same = _check("--json", _gpu_check_json(tmp_path))
    assert same.returncode == 0, same.stderr
    other = _check("--json", _gpu_check_json(tmp_path, deepspeed="0.19.9", cuda="12.8"))
    assert other.returncode == 1
    (line,) = other.stderr.splitlines()
    assert line.startswith("error: ") and "is not the GPU-tested stack" in line
    assert f"deepspeed: stack {STACK['deepspeed']}, found 0.19.9" in line
    assert f"cuda: stack {STACK['cuda']}, found 12.8" in line and "torch:" not in line


def test_write_records_a_gpu_check_as_the_stack(tmp_path):
    stack = tmp_path / "gpu_stack.txt"
    stack.write_text((REPO / "docker" / "gpu_stack.txt").read_text())
    check = _gpu_check_json(tmp_path, transformers="5.24.0", gpu="NVIDIA H200")
    assert _check("--json", check, "--stack", str(stack)).returncode == 1
    assert _check("--json", check, "--stack", str(stack), "--write").returncode == 0
    written = gpu_stack.read_stack(stack)
    assert written == {**STACK, "transformers": "5.24.0"}  # torch without its +cu label
    text = stack.read_text()
    assert "# Last GPU check: " in text and "NVIDIA H200, driver 580.159.04" in text
    assert text.startswith("# The GPU-tested stack")  # the explanation is kept
    assert _check("--json", check, "--stack", str(stack)).returncode == 0
