"""The C++ linear kernels (panel_gemm, pair_gemm, amx_gemm), their weight packings, and the route
`Linear` takes: against float64 F.linear, and each row against itself alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.backends.cpu.linears import Linear, pack_amx, pack_pairs, pack_panels

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels here (no compiler, or a CPU without "
                                                    "AVX-512): the torch fallback is tested instead")
amx = pytest.mark.skipif(ops is None or not ops.amx_gemm_available(), reason="this CPU has no AMX tiles")
pairs = pytest.mark.skipif(ops is None or not ops.pair_gemm_available(), reason="this build has no AVX512-BF16")


def _check(gemm, packed, w, dtype, ms=(1, 3, 13, 14, 15, 16, 29, 64, 130, 300)):
    """gemm(x[:m]) against float64 F.linear for several m, with and without bias; then each of a few rows
    computed alone equals that row computed among all the others."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(max(ms), k, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for m in ms:
        for b in (None, bias):
            got = gemm(x[:m], packed, n, b)
            assert got.shape == (m, n) and got.dtype == dtype
            want = F.linear(x[:m].double(), w.double(), None if b is None else b.double())
            assert torch.allclose(got.double(), want, atol=tol * k ** 0.5, rtol=tol), (m, b is None)
    assert gemm(x[:0], packed, n, bias).shape == (0, n)
    full = gemm(x, packed, n, bias)
    for i in (0, 7, 13, 14, 19, len(x) - 1):
        assert torch.equal(gemm(x[i:i + 1], packed, n, bias)[0], full[i])
    assert torch.equal(gemm(x[:40].t().contiguous().t(), packed, n, bias), full[:40])  # strided x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(96, 64), (100, 48), (7, 33), (576, 1536)])
def test_panel_gemm_matches_linear_and_does_not_depend_on_the_batch(dtype, n, k):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) / k ** 0.5).to(dtype)
    panels = pack_panels(w)
    assert panels.shape == (-(-n // 32), k, 32)
    _check(ops.panel_gemm, panels, w, dtype)


@pairs
@pytest.mark.parametrize("n, k", [(96, 64), (100, 48), (7, 34), (576, 1536)])
def test_pair_gemm_matches_linear_and_does_not_depend_on_the_batch(n, k):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) / k ** 0.5).to(torch.bfloat16)
    _check(ops.pair_gemm, pack_pairs(w), w, torch.bfloat16)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.pair_gemm(torch.zeros(2, k + 2, dtype=torch.bfloat16), pack_pairs(w), n, None)


@amx
@pytest.mark.parametrize("n, k", [(96, 64), (100, 32), (7, 96), (576, 1536)])
def test_amx_gemm_matches_linear_and_does_not_depend_on_the_batch(n, k):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) / k ** 0.5).to(torch.bfloat16)
    _check(ops.amx_gemm, pack_amx(w), w, torch.bfloat16, ms=(1, 15, 16, 17, 32, 33, 48, 100, 256, 257, 530))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.amx_gemm(torch.zeros(4, k + 32, dtype=torch.bfloat16), pack_amx(w), n, None)


def test_packings_put_each_weight_where_its_kernel_reads_it():
    n, k = 40, 64  # two panels, the second one mostly zero padding
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).to(torch.bfloat16)
    panels, pair, tiles = pack_panels(w), pack_pairs(w), pack_amx(w)
    assert pair.shape == (2, 32, 32, 2)  # panels, k pairs, columns, pair
    assert tiles.shape == (2, 2, 2, 16, 16, 2)  # panels, K slices, column tiles, k pairs, columns, pair
    for col in (0, 15, 16, 31, 32, 39):
        for kk in (0, 1, 30, 31, 32, 63):
            p, c = divmod(col, 32)
            assert panels[p, kk, c] == w[col, kk]
            assert pair[p, kk // 2, c, kk % 2] == w[col, kk]
            assert tiles[p, kk // 32, c // 16, kk % 32 // 2, c % 16, kk % 2] == w[col, kk]
    assert panels[1, :, 8:].abs().sum() == 0 and pair[1, :, 8:].abs().sum() == 0
    assert tiles[1, :, :, :, 8:].abs().sum() == 0 and tiles[1, :, 1].abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_amx(torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="odd"):
        pack_pairs(torch.zeros(32, 33, dtype=torch.bfloat16))


class _WithoutAmx:
    """The kernels as a CPU without AMX tiles sees them."""

    def __getattr__(self, name):
        return getattr(ops, name)

    def amx_gemm_available(self):
        return False


def test_a_linear_takes_one_kernel_for_every_row_count():
    """The route depends on the dtype and the CPU only, never on the rows of the step."""
    g = torch.Generator().manual_seed(3)
    w32 = torch.randn(64, 96, generator=g)
    w16 = w32.to(torch.bfloat16)
    assert Linear(w32, None, ops).gemm is ops.panel_gemm
    if ops.amx_gemm_available():
        assert Linear(w16, None, ops).gemm is ops.amx_gemm
    assert Linear(w16[:, :48].contiguous(), None, ops).gemm in (ops.pair_gemm, ops.panel_gemm)  # K not 32k
    if ops.pair_gemm_available():
        assert Linear(w16, None, _WithoutAmx()).gemm is ops.pair_gemm
    assert Linear(w16[:, :33].contiguous(), None, _WithoutAmx()).gemm is ops.panel_gemm  # K odd
    for w, lin in ((w32, Linear(w32, None, ops)), (w16, Linear(w16, None, ops))):
        for m in (1, 200, 1100):
            x = torch.randn(m, 96, generator=g).to(w.dtype)
            assert torch.equal(lin(x), lin.gemm(x, lin.packed, 64, None))


@pytest.mark.skipif(cpu_kernels() is None, reason="conveyor's C++ kernels do not run on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_in_the_linear_is_torchs_gelu_of_its_output_and_row_invariant(dtype):
    """BERT's up projection with its GELU (erf form) applied as the kernel stores: close to torch's GELU of the
    linear's own output, and each row the same bits alone."""
    torch.manual_seed(0)
    linear = Linear((torch.randn(100, 96) * 0.1).to(dtype), torch.randn(100).to(dtype), cpu_kernels())
    x = torch.randn(37, 96).to(dtype)
    fused = linear(x, Linear.GELU)
    want = torch.nn.functional.gelu(linear(x).float())
    torch.testing.assert_close(fused.float(), want, rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)
    assert all(torch.equal(linear(x[i:i + 1], Linear.GELU)[0], fused[i]) for i in range(37))
