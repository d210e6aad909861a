"""dtype=auto: chosen from an injected device capability (pure), for both kinds of CPU and for GPUs."""
import pytest
import torch

from engine.capability import DeviceCapability, choose_dtype, detect_capability, parse_cpu_flags
from engine.config import EngineConfig

SAPPHIRE_RAPIDS = DeviceCapability("cpu", "AVX512", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
COOPER_LAKE = DeviceCapability("cpu", "AVX512", ("avx2", "avx512f", "avx512_bf16"))
EPYC_AVX2 = DeviceCapability("cpu", "AVX2", ("avx2",))
SKYLAKE_AVX512 = DeviceCapability("cpu", "AVX512", ("avx2", "avx512f"))  # AVX-512 but no bf16 arithmetic


@pytest.mark.parametrize("cap, dtype", [
    (SAPPHIRE_RAPIDS, torch.bfloat16), (COOPER_LAKE, torch.bfloat16),
    (EPYC_AVX2, torch.float32), (SKYLAKE_AVX512, torch.float32),
    (DeviceCapability("cpu", "DEFAULT", ()), torch.float32),
    (DeviceCapability("cuda", "AVX2", ("avx2",), (8, 0)), torch.bfloat16),
    (DeviceCapability("cuda", "AVX2", ("avx2",), (9, 0)), torch.bfloat16),
    (DeviceCapability("cuda", "AVX2", ("avx2",), (7, 5)), torch.float16),
])
def test_auto_dtype_follows_native_arithmetic(cap, dtype):
    assert choose_dtype(cap) == dtype
    record = cap.as_dict()
    assert record["auto_dtype"] == str(dtype).removeprefix("torch.") and record["native_bf16"] == (dtype == torch.bfloat16)
    assert record["cpu_capability"] == cap.cpu_capability


def test_cpu_flags_parsed_from_cpuinfo():
    text = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16 foo\nbugs\t: x\n"
    assert parse_cpu_flags(text) == ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    assert parse_cpu_flags("no flags here") == ()


def test_auto_is_the_default_and_resolves_to_this_machine():
    config = EngineConfig()
    assert config.dtype == "auto"
    assert config.torch_dtype == choose_dtype(detect_capability("cpu"))
    assert EngineConfig(dtype="fp32").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        EngineConfig(dtype="fp8")


def test_detected_capability_is_torch_s():
    cap = detect_capability("cpu")
    assert cap.cpu_capability == torch.backends.cpu.get_cpu_capability() and cap.device == "cpu"
