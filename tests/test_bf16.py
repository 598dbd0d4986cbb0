"""The bf16 codec pinned bit for bit (notes/flodl-spec.md §6).

f32 -> bf16 is round-to-nearest-even on the raw bits and must equal torch's own
cast for every non-NaN input; a NaN becomes a quiet NaN that keeps its sign,
``(bits >> 16) | 0x40`` (torch's cast is not the reference there). bf16 -> f32 is
exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_shm import kernels

pytestmark = pytest.mark.timeout(120)


def ours_f32_to_bf16(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape[0], np.uint16)
    kernels.f32_to_bf16(np.ascontiguousarray(x, np.float32), out)
    return out


def ours_bf16_to_f32(h: np.ndarray) -> np.ndarray:
    out = np.empty(h.shape[0], np.float32)
    kernels.bf16_to_f32(np.ascontiguousarray(h, np.uint16), out)
    return out


def torch_f32_to_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def spec_nan_rule(x: np.ndarray) -> np.ndarray:
    """The spec's NaN encoding, ``(bits >> 16) | 0x40``, computed by numpy."""
    return ((x.view(np.uint32) >> 16) | 0x40).astype(np.uint16)


def f32_from_bits(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


# --- the spec's table -------------------------------------------------------------

SPEC_TABLE = [
    (1.0, 0x3F80, "exact"),
    (1.0 + 2.0**-8, 0x3F80, "tie -> even (down)"),
    (1.0 + 3 * 2.0**-8, 0x3F82, "tie -> even (up)"),
    (-2.5, 0xC020, "negative"),
    (1.0 / 3.0, 0x3EAB, "rounds up"),
    (3.4e38, 0x7F80, "overflow -> +inf"),
    (-3.4e38, 0xFF80, "overflow -> -inf"),
    (float("inf"), 0x7F80, "+inf"),
    (float("-inf"), 0xFF80, "-inf"),
    (0.0, 0x0000, "+0"),
    (-0.0, 0x8000, "-0 keeps its sign"),
]


@pytest.mark.parametrize("value,bits,why", SPEC_TABLE, ids=[t[2] for t in SPEC_TABLE])
def test_spec_table(value: float, bits: int, why: str) -> None:
    got = ours_f32_to_bf16(np.array([value], np.float32))[0]
    assert got == bits, f"{value!r} ({why}): got 0x{int(got):04X}, want 0x{bits:04X}"


def test_nan_is_quieted_and_keeps_its_sign() -> None:
    # signalling NaNs whose payload lives only in the low 16 bits would truncate
    # to an infinity; the rule quiets them instead, sign kept.
    x = f32_from_bits(0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF,
                      0x7F810000, 0xFFA5A5A5)
    assert np.isnan(x).all()
    got = ours_f32_to_bf16(x)
    assert [hex(v) for v in got] == ["0x7fc0", "0xffc0", "0x7fc0", "0xffc0", "0x7fff", "0xffff",
                                     "0x7fc1", "0xffe5"]
    back = ours_bf16_to_f32(got)
    assert np.isnan(back).all()
    assert list(np.signbit(back)) == list(np.signbit(x))


# --- exhaustive bf16 -> f32 -> bf16 -------------------------------------------------


def test_every_bf16_pattern_round_trips() -> None:
    """All 65,536 patterns: bf16 -> f32 is exact (bits << 16) and f32 -> bf16 gives
    the pattern back; the only patterns that change are signalling NaNs, which
    come back quieted (| 0x40) with their sign."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = ours_bf16_to_f32(h)
    assert np.array_equal(f.view(np.uint32), h.astype(np.uint32) << 16)
    back = ours_f32_to_bf16(f)
    is_nan = np.isnan(f)
    assert is_nan.sum() == 2 * 127  # 2 signs x (2**7 - 1) non-zero mantissas
    assert np.array_equal(back[~is_nan], h[~is_nan])
    assert np.array_equal(back[is_nan], h[is_nan] | 0x40)
    # torch agrees on the decode side for every pattern (NaNs compare as NaN)
    tf = torch.from_numpy(h.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(tf[~is_nan].view(np.uint32), f[~is_nan].view(np.uint32))
    assert np.isnan(tf[is_nan]).all()


# --- f32 -> bf16 against torch on >= 10^6 values ----------------------------------


def _hard_f32_values() -> np.ndarray:
    """Bit patterns chosen to hit every rounding path, plus 2^21 random ones."""
    rng = np.random.default_rng(20261129)
    parts = [rng.integers(0, 1 << 32, size=1 << 21, dtype=np.uint64).astype(np.uint32)]
    # Every low-16-bit pattern under a few high halves: below/at/above the tie, for
    # an even and an odd kept lsb, in normals, subnormals, near overflow and zero.
    highs = np.array([0x3F80, 0x3F81, 0x0000, 0x0001, 0x007F, 0x0080, 0x7F7E, 0x7F7F,
                      0x8000, 0x8001, 0xBF80, 0xBF81, 0xFF7F, 0x4049, 0x00FF, 0x7F00],
                     np.uint32)
    lows = np.arange(1 << 16, dtype=np.uint32)
    parts.append(((highs[:, None] << 16) | lows[None, :]).ravel())
    # exact ties at random high halves (low half == 0x8000)
    parts.append((rng.integers(0, 1 << 16, size=1 << 16).astype(np.uint32) << 16) | 0x8000)
    # the extremes by name
    parts.append(np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
                           0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # subnormal ends
                           0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # min normal, max finite
                           0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001],  # just under / at / over the inf tie
                          np.uint32))
    return np.concatenate(parts).view(np.float32)


def test_f32_to_bf16_matches_torch_on_a_million_values() -> None:
    x = _hard_f32_values()
    assert x.size >= 1_000_000
    finite = np.isfinite(x)
    assert (np.abs(x[finite]) < np.finfo(np.float32).tiny).sum() > 100_000  # subnormals
    assert np.isinf(x).sum() >= 2
    ours = ours_f32_to_bf16(x)
    nan = np.isnan(x)
    ref = torch_f32_to_bf16(x)
    bad = np.flatnonzero((ours != ref) & ~nan)
    assert bad.size == 0, (
        f"{bad.size} mismatches vs torch, first: f32 0x{x.view(np.uint32)[bad[0]]:08X} "
        f"-> ours 0x{ours[bad[0]]:04X}, torch 0x{ref[bad[0]]:04X}"
    )
    assert nan.sum() > 1000
    assert np.array_equal(ours[nan], spec_nan_rule(x[nan]))


def test_rounding_formula_reference_in_numpy() -> None:
    """The kernel equals the spec's formula evaluated independently in numpy
    (32-bit unsigned arithmetic), NaNs included."""
    x = _hard_f32_values()[: 1 << 20]
    b = x.view(np.uint32)
    rne = ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    want = np.where(np.isnan(x), spec_nan_rule(x), rne)
    assert np.array_equal(ours_f32_to_bf16(x), want)


def test_codec_on_empty_and_odd_lengths() -> None:
    for n in (0, 1, 3, 17, 1023):
        x = np.linspace(-3, 3, n, dtype=np.float32)
        assert np.array_equal(ours_f32_to_bf16(x), torch_f32_to_bf16(x))
        assert np.array_equal(ours_bf16_to_f32(ours_f32_to_bf16(x)),
                              torch.from_numpy(x).bfloat16().float().numpy())


def test_codec_on_strided_and_unaligned_views() -> None:
    """The kernels take any 1-D view, not only fresh contiguous arrays."""
    x = np.linspace(-5, 5, 301, dtype=np.float32)
    strided = x[::3]
    assert np.array_equal(ours_f32_to_bf16(strided), torch_f32_to_bf16(strided.copy()))
    raw = np.zeros(2 + 2 * 100, np.uint8)
    h = raw[1:-1].view(np.uint16)  # an odd address: not 2-byte aligned
    assert not h.flags.aligned
    kernels.f32_to_bf16(x[:100], h)
    assert np.array_equal(h, torch_f32_to_bf16(x[:100].copy()))
