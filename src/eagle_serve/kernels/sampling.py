"""Sampling hot paths: logits -> processed probabilities, and seeded sampling from them.

Vocabulary: a *key* is (seed, position, purpose). Every random draw the engine makes is a pure
function of its key, so a seeded request gives the same tokens whatever it is batched with.
Purposes separate the draws made at one position (drafting, accepting, resampling, sampling).

Sampling is an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i (the Gumbel-max trick in another form), and needs no cumulative sum.

Kernels and references draw from different generators. The reference draws SplitMix64's
stream seeded with key_seed(key), the vocabulary index as the counter (`stream_uniforms`; on
CPU eagle_serve/kernels/cpu_random.cpp computes the same bits, and runs the race in one pass); a Triton
kernel runs Philox-4x32 (what tl.rand runs) keyed by the same 64-bit key_seed(key), one key
per row, with the vocabulary index as the counter. Both are pure functions of the key, so
each is exactly repeatable and independent of batching, but they pick different (equally
distributed) tokens. Tests therefore compare kernel and reference sampling by distribution
(chi-square, fixed seeds, alpha 1e-6), and exactly wherever the outcome does not depend on the
noise (one-hot probabilities).

compute_probs: the kernel finds the top-k cut-off and the top-p cut-off by bisection over
the float bit patterns (no sort). It keeps exactly the reference's top-k set; for top-p it
keeps every token tied with the last one kept, where the reference keeps those its (unstable)
sort puts first. Both treat top_p >= 1 as off. Rows with top_p <= 0 keep the most likely
token(s).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from eagle_serve.kernels import on, use_kernel
from eagle_serve.kernels.cpu import cpu_kernels

# Purposes of a draw at one position.
SAMPLE, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3
_MASK64 = (1 << 64) - 1


def key_seed(seed: int, position: int, purpose: int) -> int:
    """splitmix64 of the key, folded to a non-negative 63-bit generator seed."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose * 0x94D049BB133111EB)
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(x: int) -> int:
    """A uint64 constant as the int64 with its bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def stream_uniforms(key: int, n: int, device="cpu") -> torch.Tensor:
    """[n] float64 in (0, 1): SplitMix64's stream seeded with `key` (a key_seed), its i-th output
    z_i as ((z_i >> 11) + 0.5) / 2^53. Counter-based, so eagle_serve/kernels/cpu_random.cpp computes the
    same bits in one pass; this is its torch form (int64 arithmetic wraps as uint64 does)."""
    i = torch.arange(1, n + 1, dtype=torch.int64, device=device)
    z = i * _int64(_GAMMA) + _int64(key)
    z = (z ^ _shr(z, 30)) * _int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _int64(_MIX2)
    z = z ^ _shr(z, 31)
    return (_shr(z, 11).double() + 0.5) * 2.0 ** -53


def keyed_uniform(seed: int, position: int, purpose: int, n: int, device="cpu") -> torch.Tensor:
    """[n] float64 uniforms in (0, 1), a pure function of the key."""
    key = key_seed(seed, position, purpose)
    kernels = cpu_kernels() if torch.device(device).type == "cpu" else None
    if kernels is not None:
        return kernels.keyed_uniforms(torch.tensor([key]), n)[0]
    return stream_uniforms(key, n, device)


@functools.lru_cache(maxsize=64)
def keyed_exponentials(seed: int, position: int, purpose: int, n: int, device="cpu") -> torch.Tensor:
    """[n] float64 Exp(1) draws, -log of keyed_uniform: the noise of a race (read-only). Cached:
    coupled speculation reads a position's SAMPLE noise when drafting it, when verifying it, and
    again when a rejected position is drafted the next round."""
    return -torch.log(keyed_uniform(seed, position, purpose, n, device))


def key_seeds(seeds: list[int], positions: list[int], purpose: int, device) -> torch.Tensor:
    """[R] int64 key_seed of each row's key: what the kernels seed Philox with."""
    return torch.tensor([key_seed(s, p, purpose) for s, p in zip(seeds, positions)],
                        dtype=torch.int64, device=device)


def compute_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), renormalised. Rows must have T > 0.

    logits: [R, V]; temperature, top_p: [R] float; top_k: [R] int (0 = off) -> probs [R, V]
    """
    assert logits.ndim == 2 and temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]
    assert bool((temperature > 0).all()), "greedy rows take the argmax, not probabilities"
    vocab = logits.shape[1]
    scaled = logits.float() / temperature.float().unsqueeze(1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    cut = k < vocab
    if bool(cut.any()):  # the k-th largest of each row, from the largest k asked (not a full sort)
        largest = torch.topk(scaled, int(k[cut].max()), dim=1).values
        kth = largest.gather(1, torch.where(cut, k - 1, 0).unsqueeze(1))
        scaled = scaled.masked_fill((scaled < kth) & cut.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    if bool((top_p < 1).any()):
        sorted_p, order = torch.sort(probs, dim=1, descending=True)
        mass_before = sorted_p.cumsum(dim=1) - sorted_p
        # keeps the top-1 always; rows with top_p = 1 keep everything (their float32 mass can
        # round to 1.0 before the tail, which must not cut it)
        drop_sorted = (mass_before >= top_p.float().unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def sample_ref(probs: torch.Tensor, seeds: list[int], positions: list[int],
               purpose: int) -> torch.Tensor:
    """One token per row by exponential race with keyed noise: argmax p / E over p > 0, E =
    keyed_exponentials(seed, position, purpose), the first index on ties. On CPU one pass of
    eagle_serve/kernels/cpu_random.cpp per row (it takes the log only where it can change the winner);
    elsewhere these tensor ops, which pick the same tokens.

    probs: [R, V] (rows need not sum to 1); seeds, positions: R ints -> [R] int64
    """
    assert probs.ndim == 2 and len(seeds) == len(positions) == probs.shape[0]
    kernels = cpu_kernels() if probs.device.type == "cpu" else None
    if kernels is not None and probs.dtype in (torch.float32, torch.float64):
        return kernels.race(probs, key_seeds(seeds, positions, purpose, "cpu"))
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for r, (seed, pos) in enumerate(zip(seeds, positions)):
        noise = keyed_exponentials(seed, pos, purpose, probs.shape[1], probs.device)
        out[r] = torch.argmax(torch.where(probs[r] > 0, probs[r].double() / noise, -1.0))
    return out


def coupled_scores(q: torch.Tensor, target_ids: torch.Tensor, vocab_size: int, seeds: list[int],
                   positions: list[int]) -> torch.Tensor:
    """Coupled drafting: the scores under which a draft distribution q runs the target's own
    sampling race at each row's position (key (seed, position, SAMPLE), as sample_ref draws).
    argmax is the token the race picks when q takes the target's place, so it is the token
    the target samples there as often as q resembles the target's distribution; a draft tree
    takes the top scores. The target's sample does not depend on q: whatever is drafted, the
    output is the target's own seeded sample.

    q: [R, V_draft] (rows sum to 1); target_ids: [V_draft] the target id of each draft id;
    vocab_size: the target's V -> [R, V_draft] float64 log q - log E (-inf where q is 0)
    """
    log_noise = {key: keyed_exponentials(*key, SAMPLE, vocab_size, q.device)[target_ids].log()
                 for key in set(zip(seeds, positions))}  # a tree level's rows share a key
    return q.double().log() - torch.stack([log_noise[key] for key in zip(seeds, positions)])


def compute_probs(logits, temperature, top_k, top_p, impl: str | None = None):
    """Dispatch: the Triton kernel on CUDA tensors (or impl="triton"), the reference otherwise."""
    if use_kernel(impl, logits):
        return compute_probs_triton(logits, temperature, top_k, top_p)
    return compute_probs_ref(logits, temperature, top_k, top_p)


def sample(probs, seeds, positions, purpose, impl: str | None = None):
    """Dispatch as compute_probs. probs: [R, V]; seeds, positions: R ints -> [R] int64"""
    if use_kernel(impl, probs):
        return sample_triton(probs, seeds, positions, purpose)
    return sample_ref(probs, seeds, positions, purpose)


def compute_probs_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor:
    """As compute_probs_ref (see the module docstring for ties and top_p >= 1). Rows must have
    T > 0, unchecked here (checking would sync with the device).

    logits: [R, V]; temperature, top_k, top_p: [R] -> probs [R, V] float32
    """
    assert logits.ndim == 2 and temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]
    assert not top_k.is_floating_point(), "top_k: [R] integer (0 = off)"
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    device = logits.device
    _probs_kernel[(rows,)](
        logits, on(temperature, device, torch.float32), on(top_k, device, torch.int64),
        on(top_p, device, torch.float32),
        out, vocab, logits.stride(0), out.stride(0), BLOCK_V=probs_block(vocab))
    return out


def sample_triton(probs: torch.Tensor, seeds: list[int], positions: list[int],
                  purpose: int) -> torch.Tensor:
    """As sample_ref, with Philox noise. probs: [R, V] -> [R] int64"""
    assert probs.ndim == 2 and len(seeds) == len(positions) == probs.shape[0]
    probs = probs if probs.stride(1) == 1 else probs.contiguous()
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    block_r, block_v = vocab_row_tile(rows, vocab)
    _sample_kernel[(triton.cdiv(rows, block_r),)](
        probs, key_seeds(seeds, positions, purpose, probs.device), out, rows, vocab,
        probs.stride(0), BLOCK_R=block_r, BLOCK_V=block_v)
    return out


def probs_block(vocab: int) -> int:
    """BLOCK_V of _probs_kernel (one program per row walks the vocabulary)."""
    return min(triton.next_power_of_2(vocab), 2048)


def vocab_row_tile(rows: int, vocab: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V) of the kernels that race a tile of rows over the vocabulary."""
    block_v = min(triton.next_power_of_2(vocab), 1024)
    return min(triton.next_power_of_2(rows), max(1, 4096 // block_v)), block_v


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _random_bits(key, counter):
    """uint32 bits: Philox-4x32 keyed by the int64 `key` at `counter` (int32), elementwise.
    Equal to tl.rand's bits for tl.rand(key, counter), but the key may differ per element."""
    key, counter = tl.broadcast(key, counter)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = counter.to(tl.uint32, bitcast=True)
    zero = tl.zeros_like(c0)
    bits, _, _, _ = tl.philox_impl(c0, zero, zero, zero, k0, k1)
    return bits


@triton.jit
def _uniform(key, counter):
    """float32 in (0, 1): (bits + 1/2) / 2^32, fine-grained near 0."""
    bits = _random_bits(key, counter).to(tl.float32)
    return bits * 2.3283064365386963e-10 + 1.1641532182693481e-10


@triton.jit
def _exponential(key, counter):
    """float32 Exp(1) noise E = -log(1 - v), accurate for small E (the race winners): a short
    series for -log1p(-v) below v = 2^-7, where 1 - v would round."""
    v = _uniform(key, counter)
    small = v * (1.0 + v * (0.5 + v * 0.3333333333333333))
    return tl.where(v < 0.0078125, small, -tl.log(1.0 - v))


@triton.jit
def _race_block(p, key, cols, start, mask, best, best_idx):
    """One vocabulary block of the exponential race for a tile of rows.
    p: [BLOCK_R, BLOCK_V] f32; key: [BLOCK_R, 1]; cols: [1, BLOCK_V] from start; best,
    best_idx: [BLOCK_R]
    (strict > keeps the first block on ties, and argmax the first column within one)."""
    score = tl.where(mask & (p > 0), p / _exponential(key, cols), -1.0)
    block_best = tl.max(score, 1)
    block_idx = tl.argmax(score, 1).to(tl.int64) + start
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_idx, best_idx)


@triton.jit(do_not_specialize=["R"])
def _sample_kernel(probs_ptr, seeds_ptr, out_ptr, R, V, stride_probs,
                   BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # probs: [R, V]; seeds: [R] int64 (key_seed per row); out: [R] int64. Grid: (cdiv(R, BLOCK_R),)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    key = tl.load(seeds_ptr + rows, mask=row_ok, other=0)[:, None]
    row_base = probs_ptr + rows.to(tl.int64)[:, None] * stride_probs
    best = tl.full([BLOCK_R], -2.0, tl.float32)
    best_idx = tl.zeros([BLOCK_R], tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = (start + tl.arange(0, BLOCK_V))[None, :]
        mask = row_ok[:, None] & (cols < V)
        p = tl.load(row_base + cols, mask=mask, other=0.0).to(tl.float32)
        best, best_idx = _race_block(p, key, cols, start, mask, best, best_idx)
    tl.store(out_ptr + rows, best_idx, mask=row_ok)


@triton.jit
def _flip(x):
    """int32 bit pattern of a float32 <-> an int32 in the floats' order (an involution)."""
    return tl.where(x < 0, x ^ 0x7FFFFFFF, x)


@triton.jit
def _scaled_logits(logits_ptr, offs, V, temp):
    x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
    return x.to(tl.float32) / temp


@triton.jit
def _top_k_cutoff(logits_ptr, V, temp, top_k, lo_val, hi_val, BLOCK_V: tl.constexpr):
    """The k-th largest scaled logit: the largest t with #(scaled >= t) >= k, by bisection over
    the ordered bit patterns between the smallest (lo_val) and the largest (hi_val)."""
    lo = _flip(lo_val.to(tl.int32, bitcast=True)).to(tl.int64)
    hi = _flip(hi_val.to(tl.int32, bitcast=True)).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            s = _scaled_logits(logits_ptr, offs, V, temp)
            above = (_flip(s.to(tl.int32, bitcast=True)).to(tl.int64) >= mid) & (offs < V)
            count += tl.sum(above.to(tl.int64), 0)
        if count >= top_k:
            lo = mid
        else:
            hi = mid - 1
    return _flip(lo.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _top_p_cutoff(logits_ptr, V, temp, kth, row_max, z, top_p, BLOCK_V: tl.constexpr):
    """The smallest probability kept by top-p: the largest t with mass(p >= t) >= top_p (bit
    patterns of non-negative floats are ordered as the floats)."""
    lo = tl.zeros([], tl.int64)
    hi = (1.0 / z).to(tl.int32, bitcast=True).to(tl.int64)  # the largest p
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        mass = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            s = _scaled_logits(logits_ptr, offs, V, temp)
            p = tl.where(s >= kth, tl.exp(s - row_max), 0.0) / z
            mass += tl.sum(tl.where(p.to(tl.int32, bitcast=True).to(tl.int64) >= mid, p, 0.0), 0)
        if mass >= top_p:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _probs_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, out_ptr, V, stride_logits,
                  stride_out, BLOCK_V: tl.constexpr):
    # logits: [R, V]; temp, top_p: [R] f32; top_k: [R] int64; out: [R, V] f32. Grid: (R,)
    row = tl.program_id(0)
    logits_ptr += row.to(tl.int64) * stride_logits
    out_ptr += row.to(tl.int64) * stride_out
    temp = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)

    row_max = tl.full([], float("-inf"), tl.float32)
    row_min = tl.full([], float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled_logits(logits_ptr, offs, V, temp)
        row_max = tl.maximum(row_max, tl.max(s, 0))
        row_min = tl.minimum(row_min, tl.min(tl.where(offs < V, s, float("inf")), 0))

    kth = tl.full([], float("-inf"), tl.float32)  # keep scaled >= kth
    if (top_k > 0) & (top_k < V):
        kth = _top_k_cutoff(logits_ptr, V, temp, top_k, row_min, row_max, BLOCK_V)

    z = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled_logits(logits_ptr, offs, V, temp)
        z += tl.sum(tl.where(s >= kth, tl.exp(s - row_max), 0.0), 0)

    p_min = tl.zeros([], tl.float32)  # keep p >= p_min
    z_kept = z
    if top_p < 1.0:
        p_min = _top_p_cutoff(logits_ptr, V, temp, kth, row_max, z, top_p, BLOCK_V)
        z_kept = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            s = _scaled_logits(logits_ptr, offs, V, temp)
            e = tl.where(s >= kth, tl.exp(s - row_max), 0.0)
            z_kept += tl.sum(tl.where(e / z >= p_min, e, 0.0), 0)

    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = _scaled_logits(logits_ptr, offs, V, temp)
        e = tl.where(s >= kth, tl.exp(s - row_max), 0.0)
        tl.store(out_ptr + offs, tl.where(e / z >= p_min, e / z_kept, 0.0), mask=offs < V)
