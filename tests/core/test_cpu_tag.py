"""The kernel build cache is keyed by CPU: a build for one CPU's instructions is never loaded on another."""

import os
import platform
import subprocess
import sys

import pytest

from conveyor.core.backends.cpu import kernels
from conveyor.core.backends.cpu.kernels import check_cpu_isa, cpu_identity, cpu_tag, route_for
from conveyor.core.errors import ConfigError

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


@pytest.mark.skipif(kernels.cpu_kernels() is None, reason="conveyor's C++ kernels do not run on this CPU")
def test_the_arithmetic_a_resume_compares_names_the_build_and_the_cpu_it_was_made_for(monkeypatch):
    """A run resumed on another CPU says its rows may differ in bits, even on the same route: the build is tuned for
    its CPU (and so is where it fuses a multiply and an add)."""
    import torch

    from conveyor.core.backends.cpu.backend import kernels_arithmetic

    here = kernels_arithmetic(kernels.cpu_kernels(), torch.float32)
    assert here.endswith(f", kernels {kernels.build_tag()} for {cpu_identity()[0]}")
    monkeypatch.setattr(kernels, "_proc_cpuinfo", lambda: XEON if "Intel" not in here else EPYC)
    assert kernels_arithmetic(kernels.cpu_kernels(), torch.float32) != here


def test_the_route_follows_the_widest_vectors_the_cpu_has(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert route_for(cpu_identity(XEON)[1]) == "native"
    assert route_for(cpu_identity(EPYC)[1]) == "native"
    assert route_for(["avx2", "fma", "sse4_2"]) == "avx2"  # Zen 2/3, Intel client parts
    assert route_for(["avx2", "sse4_2"]) is None  # AVX2 without FMA: torch
    assert route_for(["sse4_2"]) is None
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert route_for(["fp", "asimd", "sve"]) is None


def test_a_cpu_isa_that_cannot_run_is_named(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx512")
    assert check_cpu_isa() == "CONVEYOR_CPU_ISA=avx512 is not one of auto, avx2"
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    monkeypatch.setattr(kernels, "cpu_identity", lambda: ("old", ["sse4_2"]))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert "needs AVX2 and FMA, which this CPU lacks" in check_cpu_isa()
    monkeypatch.setattr(kernels, "cpu_identity", lambda: ("new", ["avx2", "fma"]))
    assert check_cpu_isa() is None
    monkeypatch.setenv("CONVEYOR_KERNEL_ARCH", "skylake-avx512")
    assert "both name the kernels' instructions" in check_cpu_isa()
    with pytest.raises(ConfigError) as e:
        kernels.select_isa("auto")
    assert e.value.field == "cpu_isa"


def test_while_the_kernels_load_the_expected_backend_and_dtype_are_the_ones_they_give():
    """The run picks `--dtype auto` and checks `--backend cpu` while the kernels build beside the model's load: what
    it expects must be what the loaded kernels give (a child process: here they have loaded already)."""
    code = ("from conveyor.core.backends.cpu import kernels as k\n"
            "k.build_in_background()\n"
            "expected = (k.kernels_expected(), k.native_bf16(wait=False))\n"
            "print(expected, (k.cpu_kernels() is not None, k.native_bf16()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    expected, loaded = done.stdout.strip().rsplit(") (", 1)
    assert done.returncode == 0 and expected + ")" == "(" + loaded, done.stdout + done.stderr


@pytest.mark.skipif(kernels.cpu_kernels() is None, reason="conveyor's C++ kernels do not run on this CPU")
def test_an_import_error_on_the_build_thread_is_retried_on_the_callers_thread():
    """Two threads importing one module at once can fail ("No module named 'platformdirs._paths'" once cost a run
    its kernels): an ImportError on the background thread is not the kernels' failure; `cpu_kernels()` loads them
    again on its caller's thread, with no warning (a child process: here they have loaded already)."""
    code = ("import threading, warnings\n"
            "from conveyor.core.backends.cpu import kernels as k\n"
            "real, calls = k.cached_build, []\n"
            "def flaky(*args, **kw):\n"
            "    calls.append(threading.current_thread().name)\n"
            "    if len(calls) == 1:\n"
            "        raise ModuleNotFoundError(\"No module named 'platformdirs._paths'\")\n"
            "    return real(*args, **kw)\n"
            "k.cached_build = flaky\n"
            "k.build_in_background()\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('error')\n"
            "    loaded = k.cpu_kernels() is not None\n"
            "print(loaded, calls, k.kernels_missing_reason())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "True ['conveyor-kernels', 'MainThread'] None", \
        done.stdout + done.stderr


@pytest.mark.skipif(kernels.cpu_route()[0] is None, reason="no route of conveyor's kernels on this CPU: no build")
def test_quiet_build_notes_keep_the_build_off_stderr(tmp_path):
    """`conveyor run --quiet` turns the build's two notes off (a cron job's log gets its closing line only); without
    it the build says what it does and what it took. A child process per case, torch's compile stubbed out (it
    writes an empty library and returns a stand-in module) and the build cached in a folder of the test's own."""
    code = ("import sys\n"
            "import torch.utils.cpp_extension as ce\n"
            "from conveyor.core.backends.cpu import kernels as k\n"
            "class Built:\n"
            "    def build_isa(self):\n"
            "        return 'avx2'\n"
            "def load(name, sources, build_directory, **kw):\n"
            "    open(f'{build_directory}/{name}.so', 'wb').close()\n"
            "    return Built()\n"
            "ce.load = load\n"
            "if sys.argv[1] == 'quiet':\n"
            "    k.quiet_build_notes()\n"
            "print(k.cpu_kernels() is not None)\n")
    said = {}
    for case in ("quiet", "loud"):
        env = {**os.environ, "CONVEYOR_CACHE_DIR": str(tmp_path / case)}
        done = subprocess.run([sys.executable, "-c", code, case], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stdout + done.stderr
        said[case] = done.stderr
    assert "kernels" not in said["quiet"], said["quiet"]
    assert "compiling the C++ CPU kernels once" in said["loud"] and "compiled the C++ CPU kernels in" in said["loud"]
