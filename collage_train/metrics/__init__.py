"""Metrics: throughput and MFU, memory, and the sinks records are streamed to."""

from collage_train.metrics.edq import edq_metrics, edq_partials, layer_group
from collage_train.metrics.memory import (
    available_memory,
    model_state_bytes,
    peak_memory,
    reset_peak_memory,
)
from collage_train.metrics.sinks import ConsoleSink, JsonlSink, RecordingSink, Sink, WandbSink
from collage_train.metrics.throughput import detect_peak_tflops, model_flops_utilisation

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "RecordingSink",
    "Sink",
    "WandbSink",
    "available_memory",
    "detect_peak_tflops",
    "edq_metrics",
    "edq_partials",
    "layer_group",
    "model_flops_utilisation",
    "model_state_bytes",
    "peak_memory",
    "reset_peak_memory",
]
