#!/usr/bin/env bash
# Keep a multi-node worker container running with an ssh server the launcher node can
# reach: port 2222 (COLLAGE_SSHD_PORT), key login only, the keys mounted at /root/.ssh.
set -euo pipefail
port="${COLLAGE_SSHD_PORT:-2222}"
if [[ ! -s /root/.ssh/authorized_keys ]]; then
    echo "error: mount the launcher's public key as /root/.ssh/authorized_keys (-v ~/.ssh:/root/.ssh:ro)" >&2
    exit 1
fi
ssh-keygen -A > /dev/null  # host keys, once per container
exec /usr/sbin/sshd -D -e -p "$port" -o PasswordAuthentication=no -o PermitRootLogin=prohibit-password
