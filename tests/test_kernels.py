"""numba kernels against plain numpy / torch references.

Fused scale (one rounding, bit-identical to ``tensor.mul``), weighted
accumulate, finalize, the multi-source reduce, ``scale_payload_bytes``, and the
kernel hygiene the hot path relies on (outputs passed in, no allocation, cache
on a writable directory).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from numba.core.runtime import _nrt_python, rtsys

from flodl_shm import kernels
from flodl_shm.errors import FrameError

pytestmark = pytest.mark.timeout(120)

W = 0.8349217  # the seed's weight: not exactly representable in f32
RNG = np.random.default_rng(7)


def f32_values(n: int, with_specials: bool = True) -> np.ndarray:
    x = (RNG.standard_normal(n) * np.exp(RNG.uniform(-20, 20, n))).astype(np.float32)
    if with_specials and n >= 8:
        x[:8] = [0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-42, 3.3e38, -3.3e38]
    return x


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    return bits16(torch.from_numpy(x).to(torch.bfloat16))


def widen(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# --- fused scale: bit-identical to tensor.mul -------------------------------------


@pytest.mark.parametrize("factor", [W, 0.5, 3.0, 1e-30, -2.75])
def test_f32_scaled_copy_is_tensor_mul(factor: float) -> None:
    x = f32_values(4099)
    out = np.empty_like(x)
    kernels.f32_scaled_copy(x, out, factor)
    assert same_bits(out, torch.from_numpy(x).mul(factor).numpy())
    kernels.f32_scaled_copy(x, x, factor)  # in place
    assert same_bits(x, out)


@pytest.mark.parametrize("factor", [W, 0.5, 1e-30, -2.75, 1e30])
def test_f32_to_bf16_scaled_rounds_once(factor: float) -> None:
    x = f32_values(4099)
    out = np.empty(x.size, np.uint16)
    kernels.f32_to_bf16_scaled(x, out, factor, np.empty(16, np.float32))
    want = torch.empty(x.size, dtype=torch.bfloat16)
    torch.mul(torch.from_numpy(x), factor, out=want)  # f32 product, one cast
    assert same_bits(out, bits16(want))
    # two roundings (cast first, then scale in bf16) would differ somewhere
    twice = bits16(torch.from_numpy(x).to(torch.bfloat16).mul(factor))
    if factor == W:
        assert not np.array_equal(out, twice)


@pytest.mark.parametrize("factor", [W, 0.5, 1e-30, -2.75, 1e30])
def test_bf16_scaled_copy_is_bf16_tensor_mul(factor: float) -> None:
    src = to_bf16_bits(f32_values(4099))
    want = bits16(torch.from_numpy(src.view(np.int16)).view(torch.bfloat16).mul(factor))
    out = np.empty_like(src)
    kernels.bf16_scaled_copy(src, out, factor, np.empty(16, np.float32))
    assert same_bits(out, want)
    kernels.bf16_scaled_copy(src, src, factor, np.empty(16, np.float32))  # in place
    assert same_bits(src, want)


def test_bf16_scaled_to_f32_is_bf16_mul_then_upcast() -> None:
    src = to_bf16_bits(f32_values(1001))
    t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    out = np.empty(src.size, np.float32)
    kernels.bf16_scaled_to_f32(src, out, W)
    assert same_bits(out, t.mul(W).float().numpy())


def test_scaled_kernels_keep_nan_quiet_and_signed() -> None:
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    x[1] = -np.abs(x[1])
    out = np.empty(3, np.uint16)
    kernels.f32_to_bf16_scaled(x, out, 2.0, np.empty(4, np.float32))
    assert np.isnan(widen(out[:2])).all() and list(np.signbit(widen(out[:2]))) == [False, True]
    assert out[2] == 0x4000


# --- scale_payload_bytes ---------------------------------------------------------

SEED_VALS = np.array([0.7314426, -1.9023375, 3.017882e-3, -42.52386], np.float32)


@pytest.mark.parametrize("tag,dtype", [(0, torch.float32), (1, torch.bfloat16)])
def test_scale_payload_bytes_is_tensor_mul_seed_values(tag: int, dtype: torch.dtype) -> None:
    t = torch.from_numpy(SEED_VALS.copy()).to(dtype)
    expected = t.mul(W).view(torch.uint8).numpy().tobytes()
    fused = bytearray(t.view(torch.uint8).numpy().tobytes())
    kernels.scale_payload_bytes(fused, tag, np.float32(W))
    assert bytes(fused) == expected
    assert bytes(fused) != t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kind", ["bytearray", "numpy", "memoryview", "unaligned"])
@pytest.mark.parametrize("tag", [0, 1])
def test_scale_payload_bytes_accepts_writable_buffers(kind: str, tag: int) -> None:
    vals = f32_values(257)
    payload = vals.tobytes() if tag == 0 else to_bf16_bits(vals).tobytes()
    want_t = torch.from_numpy(vals) if tag == 0 else torch.from_numpy(vals).to(torch.bfloat16)
    want = want_t.mul(W).view(torch.uint8).numpy().tobytes()
    if kind == "bytearray":
        buf = bytearray(payload)
        kernels.scale_payload_bytes(buf, tag, W)
        got = bytes(buf)
    elif kind == "numpy":
        buf = np.frombuffer(bytearray(payload), np.uint8)
        kernels.scale_payload_bytes(buf, tag, W)
        got = buf.tobytes()
    elif kind == "memoryview":
        backing = bytearray(b"\xee" * 4 + payload + b"\xee" * 4)
        kernels.scale_payload_bytes(memoryview(backing)[4:-4], tag, W)
        assert backing[:4] == backing[-4:] == b"\xee" * 4  # neighbours untouched
        got = bytes(backing[4:-4])
    else:
        backing = bytearray(b"\xee" + payload)
        kernels.scale_payload_bytes(memoryview(backing)[1:], tag, W)
        got = bytes(backing[1:])
    assert got == want


@pytest.mark.parametrize("tag", [2, 7, 255, -1])
def test_scale_payload_bytes_unknown_tag_is_named(tag: int) -> None:
    with pytest.raises(FrameError, match=rf"scale_payload: unsupported wire dtype tag {tag} "
                                         r"\(0 = f32, 1 = bf16\)"):
        kernels.scale_payload_bytes(bytearray(8), tag, 1.0)


def test_scale_payload_bytes_rejects_bad_buffers() -> None:
    with pytest.raises(FrameError, match="read-only"):
        kernels.scale_payload_bytes(b"\x00" * 8, 0, 2.0)
    with pytest.raises(FrameError, match="6 bytes is not a whole number of f32"):
        kernels.scale_payload_bytes(bytearray(6), 0, 2.0)
    with pytest.raises(FrameError, match="3 bytes is not a whole number of bf16"):
        kernels.scale_payload_bytes(bytearray(3), 1, 2.0)
    with pytest.raises(FrameError, match="contiguous"):
        kernels.scale_payload_bytes(np.zeros(16, np.uint8)[::2], 0, 2.0)
    kernels.scale_payload_bytes(bytearray(), 1, 2.0)  # empty payload: nothing to do


# --- accumulate / finalize --------------------------------------------------------


def test_accumulate_f32_is_two_rounded_ops() -> None:
    acc = f32_values(5003, with_specials=False)
    src = f32_values(5003, with_specials=False)
    want = acc + np.float32(W) * src  # numpy: product rounded, then sum rounded
    kernels.accumulate_f32(acc, src, W)
    assert same_bits(acc, want)


def test_accumulate_bf16_widens_exactly() -> None:
    acc = f32_values(5003, with_specials=False)
    src = to_bf16_bits(f32_values(5003, with_specials=False))
    want = acc + np.float32(W) * widen(src)
    kernels.accumulate_bf16(acc, src, W, np.empty(16, np.float32))
    assert same_bits(acc, want)


def test_finalize_f32_and_bf16() -> None:
    acc = f32_values(5003)
    inv = 1.0 / 3.0
    out = np.empty_like(acc)
    kernels.finalize_f32(acc, out, inv)
    assert same_bits(out, acc * np.float32(inv))
    out16 = np.empty(acc.size, np.uint16)
    kernels.finalize_bf16(acc, out16, inv, np.empty(16, np.float32))
    assert same_bits(out16, to_bf16_bits(acc * np.float32(inv)))
    kernels.finalize_f32(acc, acc, inv)  # in place
    assert same_bits(acc, out)


# --- the multi-source reduce ------------------------------------------------------


def reduce_reference(srcs: list[np.ndarray], inv: float) -> np.ndarray:
    """((s0 + s1) + s2) + ... in f32, then one multiply by f32(inv)."""
    total = srcs[0].astype(np.float32)
    for s in srcs[1:]:
        total = total + s
    return total * np.float32(inv)


N, START, STOP = 1000, 13, 977


@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_reduce_f32_matches_reference(nsrc: int, chunk: int) -> None:
    """Every source-count path: one fused loop up to 4 sources, then folds."""
    inv = 1.0 / (nsrc + 0.5)
    f = [f32_values(N, with_specials=False) for _ in range(nsrc)]
    out = np.full(N, np.float32(-7.0))
    kernels.reduce_f32(tuple(f), out, START, STOP, inv, np.empty(chunk, np.float32))
    assert same_bits(out[START:STOP], reduce_reference([x[START:STOP] for x in f], inv))
    assert (out[:START] == -7.0).all() and (out[STOP:] == -7.0).all()


# The source-count paths are shared with f32 (same loops, dtype-generic loads and
# stores), so bf16 is pinned on the two shapes: fused (<= 4) and folded (> 4).
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_reduce_bf16_matches_reference(nsrc: int, chunk: int) -> None:
    inv = 1.0 / (nsrc + 0.5)
    h = [to_bf16_bits(f32_values(N, with_specials=False)) for _ in range(nsrc)]
    acc, tmp = np.empty(chunk, np.float32), np.empty(chunk, np.float32)
    want = reduce_reference([widen(x[START:STOP]) for x in h], inv)

    out = np.full(N, np.float32(-7.0))
    kernels.reduce_bf16_to_f32(tuple(h), out, START, STOP, inv, acc, tmp)
    assert same_bits(out[START:STOP], want)
    assert (out[:START] == -7.0).all() and (out[STOP:] == -7.0).all()

    out16 = np.full(N, np.uint16(0xDEAD))
    kernels.reduce_bf16(tuple(h), out16, START, STOP, inv, acc, tmp)
    assert same_bits(out16[START:STOP], to_bf16_bits(want))
    assert (out16[:START] == 0xDEAD).all() and (out16[STOP:] == 0xDEAD).all()


def test_reduce_output_may_alias_a_source() -> None:
    a, b, c = (f32_values(300, with_specials=False) for _ in range(3))
    want = reduce_reference([a, b, c], 0.25)
    kernels.reduce_f32((a, b, c), a, 0, 300, 0.25, np.empty(64, np.float32))
    assert same_bits(a, want)


def test_reduce_is_deterministic_in_source_order() -> None:
    """Sums are ((s0 + s1) + s2): the caller's order, so every process agrees."""
    big, small = np.float32(1e8), np.float32(3.0)
    srcs = (np.full(8, big), np.full(8, -big), np.full(8, small))
    out = np.empty(8, np.float32)
    kernels.reduce_f32(srcs, out, 0, 8, 1.0, np.empty(4, np.float32))
    assert (out == 3.0).all()
    kernels.reduce_f32((srcs[0], srcs[2], srcs[1]), out, 0, 8, 1.0, np.empty(4, np.float32))
    assert (out == 0.0).all()  # (1e8 + 3) rounds to 1e8 in f32


# --- hygiene: no allocation, cache=True, nogil -------------------------------------

KERNEL_NAMES = ["f32_to_bf16", "bf16_to_f32", "f32_scaled_copy", "f32_to_bf16_scaled",
                "bf16_scaled_copy", "bf16_scaled_to_f32", "accumulate_f32", "accumulate_bf16",
                "finalize_f32", "finalize_bf16", "reduce_f32", "reduce_bf16",
                "reduce_bf16_to_f32"]


def _nrt_allocs(fn) -> int:
    before = rtsys.get_allocation_stats().alloc
    fn()
    return rtsys.get_allocation_stats().alloc - before


def test_hot_kernels_do_not_allocate() -> None:
    """NRT allocations per call do not grow with the element or chunk count: what
    remains is numba's per-call boxing of the array arguments, never a buffer."""
    was_on = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        def calls(n: int, chunk: int) -> list[int]:
            x = f32_values(n, with_specials=False)
            y = np.empty(n, np.float32)
            h = to_bf16_bits(x)
            h2 = h.copy()
            acc, tmp = np.empty(chunk, np.float32), np.empty(chunk, np.float32)
            runs = [
                lambda: kernels.f32_to_bf16(x, h2),
                lambda: kernels.bf16_to_f32(h, y),
                lambda: kernels.f32_scaled_copy(x, y, W),
                lambda: kernels.f32_to_bf16_scaled(x, h2, W, acc),
                lambda: kernels.bf16_scaled_copy(h, h2, W, acc),
                lambda: kernels.accumulate_bf16(y, h, W, acc),
                lambda: kernels.finalize_bf16(y, h2, W, acc),
                lambda: kernels.reduce_f32((x, y, x), y, 0, n, W, acc),
                lambda: kernels.reduce_bf16((h, h2, h), h2, 0, n, W, acc, tmp),
                lambda: kernels.reduce_bf16_to_f32((h, h2, h), y, 0, n, W, acc, tmp),
                lambda: kernels.scale_payload_bytes(y.view(np.uint8), 0, W),
                lambda: kernels.scale_payload_bytes(h2.view(np.uint8), 1, W),
            ]
            for r in runs:  # compile / load first
                r()
            return [_nrt_allocs(r) for r in runs]

        small = calls(16, 16)
        large = calls(200_000, 8)  # 25,000 chunks per reduce call
        assert small == large
        assert max(large) <= 6  # at most one boxing per array argument
    finally:
        if not was_on:
            _nrt_python.memsys_disable_stats()


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernels_release_the_gil(name: str) -> None:
    """A relay or writer thread must be able to run beside a kernel. (``cache=True``
    is shown by the on-disk index test below.)"""
    assert getattr(kernels, name).targetoptions.get("nogil") is True


@pytest.mark.timeout(180)
def test_cache_lands_in_the_configured_writable_dir(tmp_path: Path) -> None:
    """A fresh process honours FLODL_SHM_NUMBA_CACHE, writes the compiled kernels in a
    subfolder keyed by the digest of the package's compiled sources (so an edited
    helper inlined into another file's kernel can never run stale), and exports the
    base to FLODL_SHM_NUMBA_CACHE for the ranks it spawns."""
    from flodl_shm.kernels._cache import sources_digest

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["FLODL_SHM_NUMBA_CACHE"] = str(tmp_path)
    code = ("import os; from flodl_shm import kernels; kernels.warm_up(1); "
            "print(kernels.cache_dir()); print(os.environ['FLODL_SHM_NUMBA_CACHE'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=170, check=True).stdout.split()
    assert out == [str(tmp_path / f"flodl_shm-{sources_digest()}"), str(tmp_path)]
    indexed = {p.name.split("-")[0] for p in tmp_path.rglob("*.nbi")}
    for name in KERNEL_NAMES:
        module = "reduce" if name.startswith(("accumulate", "finalize", "reduce")) else "codec"
        assert f"{module}.{name}" in indexed, sorted(indexed)


@pytest.mark.timeout(120)
def test_an_unwritable_numba_cache_dir_is_said_and_replaced(tmp_path: Path) -> None:
    """A probe's NUMBA_CACHE_DIR that could not be written made numba write the kernels
    into the package's own folder (past the digest folder that keeps a stale kernel
    from running), without a word, or, with the package read-only too, failed the
    import with numba's `cannot cache function ...: no locator available`."""
    (tmp_path / "afile").write_text("")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "afile" / "cache"),
           "FLODL_SHM_NUMBA_CACHE": str(tmp_path / "good")}
    code = ("import logging, subprocess, sys; logging.basicConfig(format='%(message)s'); "
            "import numba; "  # (imported first: it re-reads NUMBA_CACHE_DIR at a compile)
            "from flodl_shm.kernels import _cache; print(_cache.cache_dir()); "
            "numba.njit(lambda x: x + 1)(1); print(numba.config.CACHE_DIR); "
            "child = subprocess.run([sys.executable, '-c', 'from flodl_shm.kernels import "
            "_cache; print(_cache.cache_dir())'], capture_output=True, text=True); "
            "print(child.stdout.strip(), repr(child.stderr)); "
            f"import os; os.environ['NUMBA_CACHE_DIR'] = {str(tmp_path / 'afile' / 'cache')!r}; "
            "_cache._chosen = None; _cache._candidates = lambda: []; "
            "_cache.configure_numba_cache()")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=110)
    chosen, after_a_compile, child = run.stdout.splitlines()[:3]
    assert chosen.startswith(str(tmp_path / "good" / "flodl_shm-")), run
    assert after_a_compile == chosen  # (it became the base, past the digest folder)
    assert child == f"{chosen} ''", child  # a rank: the same folder, nothing said again
    assert (f"NUMBA_CACHE_DIR={tmp_path}/afile/cache is not writable: flodl_shm caches its "
            f"compiled kernels in {tmp_path}/good instead") in run.stderr, run.stderr
    # nothing writable (as with a read-only package, home and temp dirs): named, not numba's
    assert run.stderr.rstrip().endswith(
        f"NoKernelCache: flodl_shm compiles its kernels once and caches them, and none of the "
        f"folders for that cache is writable here ({tmp_path}/afile/cache): set "
        f"NUMBA_CACHE_DIR to a writable folder"), run.stderr


@pytest.mark.timeout(120)
def test_a_numba_cache_dir_set_after_numba_stays_in_the_digest_folder(tmp_path: Path) -> None:
    """A regression probe's script set NUMBA_CACHE_DIR after importing numba: numba re-read
    it at its next compile and cached past the sources-digest folder. And a variable that
    names an older version's digest folder put this version's inside it."""
    from flodl_shm.kernels._cache import sources_digest

    mine = tmp_path / f"flodl_shm-{sources_digest()}"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    code = ("import os, sys, numba; os.environ['NUMBA_CACHE_DIR'] = sys.argv[1]; "
            "from flodl_shm.kernels import _cache; print(_cache.cache_dir()); "
            "numba.njit(lambda x: x + 1)(1); print(numba.config.CACHE_DIR)")
    for preset in (tmp_path, tmp_path / "flodl_shm-0123456789ab"):
        run = subprocess.run([sys.executable, "-c", code, str(preset)], env=env,
                             capture_output=True, text=True, timeout=110)
        assert run.stdout.split() == [str(mine), str(mine)], run


@pytest.mark.timeout(120)
def test_digest_folders_unused_for_a_week_are_removed_beside_the_chosen_one(
        tmp_path: Path) -> None:
    """Each version compiles into a digest folder of its own (a checkout's __pycache__
    held 22 of them, 105 MB, after two days of edits), which nothing removed. A process
    now marks the folder it chooses as used and removes the digest folders beside it
    unused for STALE_DIGEST_AGE_S; anything else in the base stays."""
    import time as _time

    from flodl_shm.kernels._cache import STALE_DIGEST_AGE_S, sources_digest

    def folder(name: str, age_s: float) -> Path:
        p = tmp_path / name
        (p / "sub").mkdir(parents=True)
        (p / "sub" / "x.nbi").write_bytes(b"")
        t = _time.time() - age_s
        os.utime(p, (t, t))
        return p

    week = STALE_DIGEST_AGE_S
    mine = folder(f"flodl_shm-{sources_digest()}", 2 * week)   # unused long, chosen now
    folder("flodl_shm-aaaaaaaaaaaa", week + 60)                  # stale: removed
    folder("flodl_shm-bbbbbbbbbbbb", week - 3600)                # used within the week
    folder("flodl_shm-cccccccccccc.stale-12345", 0)              # a killed pruner's
    folder("flodl_shm-notadigest", 2 * week)                     # not ours to judge
    folder("other", 2 * week)
    (tmp_path / "flodl_shm-dddddddddddd").symlink_to(tmp_path / "other")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["FLODL_SHM_NUMBA_CACHE"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", "from flodl_shm.kernels import _cache; "
                          "print(_cache.cache_dir())"], env=env, capture_output=True,
                         text=True, timeout=110)
    assert run.stdout.split() == [str(mine)], run
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        mine.name, "flodl_shm-bbbbbbbbbbbb", "flodl_shm-notadigest", "other",
        "flodl_shm-dddddddddddd"])
    assert _time.time() - mine.stat().st_mtime < 60, "the chosen folder is marked used"
    assert (tmp_path / "other" / "sub" / "x.nbi").exists()
