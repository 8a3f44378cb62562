"""The kernel build cache is keyed by CPU: a build for one CPU's instructions is never loaded on another."""

import platform

from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_tag, kernels_pay_off

XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu avx2 avx512f amx_tile\n" \
       "\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu avx2 avx512f amx_tile\n"
EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def test_tag_is_stable_and_differs_between_cpus():
    assert cpu_tag(XEON) == cpu_tag(XEON)
    assert cpu_tag(XEON) != cpu_tag(EPYC)


def test_tag_follows_instruction_sets_not_only_the_model_name():
    fewer = XEON.replace(" amx_tile", "")
    assert cpu_tag(fewer) != cpu_tag(XEON)
    assert cpu_tag(XEON.replace("fpu avx2", "avx2 fpu")) == cpu_tag(XEON)  # order of flags does not matter


def test_tag_without_cpuinfo_is_still_a_tag():
    tag = cpu_tag("")
    assert len(tag) == 12 and all(c in "0123456789abcdef" for c in tag)


def test_kernels_are_used_only_with_avx512_registers(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert kernels_pay_off(cpu_identity(XEON)[1])
    assert kernels_pay_off(cpu_identity(EPYC)[1])
    assert not kernels_pay_off(cpu_identity(XEON.replace(" avx512f", ""))[1])  # AVX2 only: torch is faster
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not kernels_pay_off(["fp", "asimd", "sve"])
