"""vllm.platforms.current_platform as vLLM 0.31 reports CUDA: it has sleep mode."""

from types import SimpleNamespace

current_platform = SimpleNamespace(
    device_type="cuda", is_sleep_mode_available=lambda: True, is_cpu=lambda: False
)
