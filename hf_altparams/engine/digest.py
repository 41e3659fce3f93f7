"""Exact digests of tensors' bytes: what the drift check and the frozen-prefix check compare.

A digest here is an integer computed from a tensor's raw bytes, read as 64-bit
words, in one pass over memory, on the tensor's own device:

* **exact**: integer sums (modulo 2**64), so the result does not depend on the
  order of the reduction, the thread count or the kernel, and two ranks holding
  the same bytes get the same digest; a change of any single element, however
  small (one ulp, one flipped bit), always changes it;
* **position-aware**: the words are summed in 64 contiguous chunks, and the
  chunk sums are weighted by fixed odd constants, so moving values from one
  chunk to another (a swapped row) changes it too. Changes of several elements
  that cancel exactly within one chunk are not seen (no digest this cheap can
  see everything; the drift check is a tripwire, not a cryptographic proof);
* **cheap**: a memory-bound pass, like a ``sum()``; 64-bit integer sums run at
  the speed of a float sum (``benchmarks/RESULTS.md`` has the figures).

:func:`tensor_digest` returns a 0-dim int64 tensor on the tensor's device (no
host sync); :func:`digest_many` digests a list of tensors with few kernels
(small ones concatenated first: a model's biases and norms would otherwise cost
one launch each); :func:`digest_values` turns digests into Python ints with one
copy per device; :func:`combine` folds a sequence of ints into one.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import torch

__all__ = ["combine", "digest_many", "digest_values", "tensor_digest"]

_CHUNKS = 64
_MASK = (1 << 64) - 1


def _odd_constants(count: int) -> list[int]:
    """``count`` fixed odd 62-bit constants (splitmix64 of 1, 2, ...): the chunk weights."""
    out = []
    state = 0
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z ^= z >> 31
        out.append((z >> 2) | 1)  # below 2**62: a valid int64, odd
    return out


_WEIGHTS = _odd_constants(_CHUNKS + 2)


def _as_int64(value: int) -> int:
    """``value`` modulo 2**64, as the signed int64 a tensor holds."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


_weights_on: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    weights = _weights_on.get(device)
    if weights is None:
        weights = _weights_on[device] = torch.tensor(_WEIGHTS, dtype=torch.int64, device=device)
    return weights


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 view (a copy only when it is not contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)  # bool has no view to another dtype
    return flat.view(torch.uint8)


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """An exact, position-aware digest of ``tensor``'s bytes: a 0-dim int64 tensor on its device.

    Reads the tensor once (see the module docstring); a DTensor must be passed
    as its local part (``to_local()``).

    Example:
        >>> a = torch.arange(1000, dtype=torch.float32)
        >>> b = a.clone(); b[500] = torch.nextafter(b[500], torch.tensor(1e9))  # one ulp
        >>> int(tensor_digest(a)) == int(tensor_digest(a.clone())), int(tensor_digest(a)) == int(tensor_digest(b))
        (True, False)
    """
    raw = _bytes_of(tensor)
    if raw.storage_offset() % 8:
        raw = raw.clone()  # an int64 view needs 8-byte alignment (a rare sliced parameter)
    weights = _weights(raw.device)
    whole = raw.numel() - raw.numel() % 8
    words = raw[:whole].view(torch.int64)
    per_chunk = words.numel() // _CHUNKS
    body = per_chunk * _CHUNKS
    # The common case (a parameter of 512 bytes or a multiple): four kernels.
    digest = (
        (words[:body].view(_CHUNKS, per_chunk).sum(dim=1) * weights[:_CHUNKS]).sum()
        if per_chunk
        else torch.zeros((), dtype=torch.int64, device=raw.device)
    )
    if body < words.numel():
        rest = words[body:]
        digest = digest + (rest * weights[: rest.numel()]).sum() * weights[_CHUNKS]
    if whole < raw.numel():
        tail = raw[whole:].to(torch.int64)
        shifts = torch.arange(tail.numel(), device=raw.device, dtype=torch.int64) * 8
        digest = digest + (tail << shifts).sum() * weights[_CHUNKS + 1]
    return digest + _as_int64(raw.numel() * _WEIGHTS[_CHUNKS + 1])  # the length: empty and zero tensors differ


_SMALL = 1 << 20  # bytes: tensors up to this size are concatenated before digesting


def digest_many(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Digests standing for ``tensors`` (in order): one per large tensor, one per device for the small ones.

    Equal lists of tensors (same shapes, bytes and devices, in the same order)
    give equal digests; any changed element changes one of them.

    Example:
        >>> a, b = [torch.zeros(3), torch.ones(2)], [torch.zeros(3), torch.ones(2)]
        >>> digest_values(digest_many(a)) == digest_values(digest_many(b))
        True
        >>> b[1][0] = 2.0
        >>> digest_values(digest_many(a)) == digest_values(digest_many(b))
        False
    """
    out: list[torch.Tensor] = []
    small: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        raw = _bytes_of(tensor)
        if raw.numel() > _SMALL:
            out.append(tensor_digest(raw))
        else:
            small.setdefault(raw.device, []).append(raw)
    for _, parts in small.items():
        out.append(tensor_digest(torch.cat(parts)))
    return out


def digest_values(digests: Sequence[torch.Tensor]) -> list[int]:
    """The Python ints of ``digests`` (0-dim int64 tensors), one copy to the host per device.

    Example:
        >>> digest_values([torch.tensor(3), torch.tensor(-1)])
        [3, 18446744073709551615]
    """
    out: list[int] = [0] * len(digests)
    by_device: dict[torch.device, list[int]] = {}
    for i, d in enumerate(digests):
        by_device.setdefault(d.device, []).append(i)
    for _, where in by_device.items():
        values = torch.stack([digests[i] for i in where]).tolist()
        for i, value in zip(where, values):
            out[i] = int(value) & _MASK
    return out


def combine(values: Iterable[object]) -> int:
    """One int below 2**60 standing for the sequence ``values`` (order matters; equal on every rank).

    Example:
        >>> combine([1, 2]) == combine([1, 2]), combine([1, 2]) == combine([2, 1])
        (True, False)
    """
    text = ",".join(str(v) for v in values)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
