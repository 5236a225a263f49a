"""Structured Jacobian blocks.

A block is the Jacobian of one array (the "out" side) with respect to one input array (the
"in" side): a tensor of shape `out_shape + in_shape`, stored as a small array `val` and a
labelling of axes, in the spirit of einsum notation (graphax's sparse tensors and
neural-tangents' structured derivatives do the same):

- every out axis and every in axis carries a label;
- a label shared by an out axis and an in axis is a Kronecker delta between them (identity
  along that pair of axes: the block is diagonal there);
- `val`'s axes carry labels too. A label not among `val`'s is one along which `val` is
  constant: a broadcast axis, or, for a shared label, a delta with constant values.

So `J[o, i] = val[...] * prod_L delta(o_L, i_L)`, the product over shared labels. The identity
is a scalar `val` of one with every axis shared; a diagonal has `val` of the out shape with
every axis shared; a dense block has every label in `val` and none shared.

Deltas describe maps that keep each element in place. Maps that move elements (slices,
padding, concatenation, reversal, reshapes that regroup a diagonal, gathers with known
indices) and sums of them (stencils, block-diagonal systems) are described by an `Ell`: a
row-compressed (ELLPACK) pattern known at trace time. A block with an `Ell` has no deltas;
instead each out position `o` holds `S` entries `s`, entry `s` pointing at the flat index
`tmap[s, o]` of the in axes `ell.in_axes`:

    J[o, i] = sum_s val[..., s] * mask[s, o] * [ravel(i[in_axes]) == tmap[s, o]],

with `val`'s entry axis labelled `BAND`. `tmap` and `mask` are NumPy arrays: the sparsity
pattern is static, only `val` is traced. Entries outside `mask` are not part of the block,
whatever `val` holds there (so that `val` can stay constant along an axis that was padded).

`val` may be a NumPy array: then it is known at trace time, and multiplying by a NumPy one
is skipped, so that the Jacobian of `x -> A @ x` is `A` itself.
"""

import hashlib
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


_fresh_labels = itertools.count(1_000_000)

BAND = -1
"""The label of the entry axis of an `Ell` block's `val`."""


def fresh_label() -> int:
    """A label not used by any canonical block (canonical labels are small integers)."""
    return next(_fresh_labels)


def is_unit(val) -> bool:
    """Whether `val` is a NumPy array of ones with no axes: multiplying by it is a no-op."""
    return isinstance(val, np.ndarray) and val.shape == () and bool(val == 1)


def is_known(val) -> bool:
    """Whether `val` is known at trace time (a NumPy array)."""
    return isinstance(val, np.ndarray | np.generic)


def place(arr, labels: Sequence[int], target: Sequence[int]):
    """Transpose and reshape `arr` (axes labelled `labels`) so that it broadcasts against an
    array whose axes are labelled `target`: its axes at their labels' positions, size one
    elsewhere."""
    labels = list(labels)
    target = list(target)
    pos = [target.index(label) for label in labels]
    order = sorted(range(len(labels)), key=lambda a: pos[a])
    if order != list(range(len(labels))):
        arr = arr.transpose(order)
    shape = [1] * len(target)
    for a in order:
        shape[pos[a]] = arr.shape[order.index(a)]
    if tuple(shape) != tuple(arr.shape):
        arr = arr.reshape(shape)
    return arr


def expand(arr, labels: Sequence[int], target: Sequence[int], sizes: dict[int, int], traced=False):
    """`arr` (axes labelled `labels`) broadcast to the full shape of `target`. With
    `traced`, a NumPy `arr` is broadcast in the program (so that a small known array
    combined with traced ones does not become a large constant)."""
    full = tuple(sizes[label] for label in target)
    arr = place(arr, labels, target)
    if traced and is_known(arr):
        arr = jnp.asarray(arr)
    if tuple(arr.shape) != full:
        arr = np.broadcast_to(arr, full) if is_known(arr) else jnp.broadcast_to(arr, full)
    return arr


def contract(operands, keep: Sequence[int], sizes: dict[int, int]):
    """Einsum over labelled operands.

    **Arguments:**

    - `operands`: `(array, labels)` pairs.
    - `keep`: labels to keep, in order; any other label present is summed over.
    - `sizes`: the size of every label.

    **Returns:** `(array, labels)`, the labels being those of `keep` that appear in some
    operand. Operands that are NumPy scalar ones are dropped. Where nothing is summed the
    result is a broadcasting product (never a `dot_general`).
    """
    operands = [(a, tuple(ls)) for a, ls in operands if not is_unit(a)]
    if not operands:
        return np.ones((), dtype=np.float32), ()
    present = []
    for _, ls in operands:
        for label in ls:
            if label not in present:
                present.append(label)
    out_labels = tuple(label for label in keep if label in present)
    summed = [label for label in present if label not in out_labels]
    repeated = any(len(set(ls)) != len(ls) for _, ls in operands)
    if not summed and not repeated:
        result = None
        for arr, ls in operands:
            placed = place(arr, ls, out_labels)
            result = placed if result is None else result * placed
        full = tuple(sizes[label] for label in out_labels)
        if tuple(result.shape) != full:
            result = (
                np.broadcast_to(result, full)
                if is_known(result)
                else jnp.broadcast_to(result, full)
            )
        return result, out_labels
    if len(operands) == 1 and not repeated:
        arr, ls = operands[0]
        axes = tuple(ls.index(label) for label in summed)
        arr = arr.sum(axis=axes)
        rest = tuple(label for label in ls if label not in summed)
        return place(arr, rest, out_labels), out_labels
    if (
        len(operands) == 2
        and out_labels
        and not repeated
        and set(operands[0][1]) == set(operands[1][1])
    ):
        # A product of two operands over the same labels, then a sum (`ab,ab->a`). As a
        # `dot_general` every kept label is a batch dimension, which XLA's CPU backend runs
        # as a loop of tiny dots, and as a `sum` it becomes a reduction fusion several
        # times slower than a matrix-vector product (measured in `benchmarks/step_cost.py`,
        # where this is the Ito Milstein correction): the product, then a product with
        # ones. `HIGHEST` keeps a GPU's default TF32 from rounding it.
        (a, la), (b, lb) = operands
        order = out_labels + tuple(summed)
        prod = place(a, la, order) * place(b, lb, order)
        kept = prod.shape[: len(out_labels)]
        flat = prod.reshape(math.prod(kept), -1)
        ones = jnp.ones(flat.shape[1], flat.dtype)
        result = jnp.matmul(flat, ones, precision=jax.lax.Precision.HIGHEST).reshape(kept)
        return result, out_labels
    if len(operands) == 2 and not repeated:
        return _pairwise(*operands[0], *operands[1], out_labels, sizes), out_labels
    letters = {}
    for label in present:
        letters[label] = _LETTERS[len(letters)]
    spec = ",".join("".join(letters[label] for label in ls) for _, ls in operands)
    spec += "->" + "".join(letters[label] for label in out_labels)
    result = jnp.einsum(spec, *[arr for arr, _ in operands])
    return result, out_labels


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _pairwise(a, la, b, lb, out_labels, sizes):
    """The contraction of two operands (no label repeated within one) as one matrix
    product of reshaped operands, `(batch, free, contracted) @ (batch, contracted, free)`,
    with the labels of each group in the order of the larger operand, so that it is not
    transposed. (`jnp.einsum` hands XLA a `dot_general` with several contracting
    dimensions, which its CPU backend runs 5-8x slower than the same contraction reshaped:
    `imk,km->i` at 64 x 64 x 64, 91 against 17 us.) Labels of one operand only that are
    not kept are summed first. Returns the result with its axes in `out_labels` order."""

    def presum(arr, ls, other):
        drop = [label for label in ls if label not in other and label not in out_labels]
        if drop:
            arr = arr.sum(axis=tuple(ls.index(label) for label in drop))
            ls = tuple(label for label in ls if label not in drop)
        return arr, ls

    a, la = presum(a, la, lb)
    b, lb = presum(b, lb, la)
    if not any(label in lb and label not in out_labels for label in la):
        return place(a, la, out_labels) * place(b, lb, out_labels)
    if np.size(b) > np.size(a):
        a, la, b, lb = b, lb, a, la
    # `a` is the larger operand: the order of its labels sets the order within each group.
    batch = tuple(label for label in la if label in lb and label in out_labels)
    contracted = tuple(label for label in la if label in lb and label not in out_labels)
    free_a = tuple(label for label in la if label not in lb)
    free_b = tuple(label for label in lb if label not in la)
    if la == batch + contracted + free_a:  # `a` on the right needs no transpose
        lhs, l_lhs, free_l, rhs, l_rhs, free_r = b, lb, free_b, a, la, free_a
    else:
        lhs, l_lhs, free_l, rhs, l_rhs, free_r = a, la, free_a, b, lb, free_b

    def arrange(arr, ls, order):
        perm = tuple(ls.index(label) for label in order)
        return arr if perm == tuple(range(len(perm))) else arr.transpose(perm)

    def size(labels):
        return math.prod(sizes[label] for label in labels)

    nb, nk = size(batch), size(contracted)
    lhs = arrange(lhs, l_lhs, batch + free_l + contracted).reshape(nb, size(free_l), nk)
    rhs = arrange(rhs, l_rhs, batch + contracted + free_r).reshape(nb, nk, size(free_r))
    if batch:
        result = jnp.matmul(lhs, rhs)
    else:
        result = jnp.matmul(lhs[0], rhs[0])
    labels = batch + free_l + free_r
    result = result.reshape(tuple(sizes[label] for label in labels))
    return place(result, labels, out_labels)


def eye(n: int, dtype):
    return jnp.eye(n, dtype=dtype)


def _digest(arr) -> str | None:
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    return hashlib.blake2b(arr.tobytes() + str(arr.shape).encode(), digest_size=16).hexdigest()


class Ell:
    """The static part of a row-compressed block: for each of `S` entries and each out
    position, the flat index (over the in axes `in_axes`) the entry points at, and whether
    the entry can be nonzero. Immutable; see the module docstring."""

    __slots__ = ("tmap", "mask", "in_axes", "_key")

    def __init__(self, tmap, mask, in_axes):
        tmap = np.asarray(tmap)
        if tmap.dtype != np.int32:
            tmap = tmap.astype(np.int32)
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.all():
                mask = None
            else:
                assert mask.shape == tmap.shape, (mask.shape, tmap.shape)
        self.tmap = tmap
        self.mask = mask
        self.in_axes = tuple(in_axes)
        self._key = None

    @property
    def S(self) -> int:
        return self.tmap.shape[0]

    def full_mask(self):
        return np.ones(self.tmap.shape, bool) if self.mask is None else self.mask

    @property
    def key(self):
        if self._key is None:
            self._key = (self.in_axes, self.tmap.shape, _digest(self.tmap), _digest(self.mask))
        return self._key


@jax.tree_util.register_pytree_node_class
class Struct:
    """One structured Jacobian block; see the module docstring. Immutable."""

    __slots__ = (
        "val",
        "val_labels",
        "out_labels",
        "in_labels",
        "out_shape",
        "in_shape",
        "ell",
    )

    def __init__(self, val, val_labels, out_labels, in_labels, out_shape, in_shape, ell=None):
        self.val = val
        self.val_labels = tuple(val_labels)
        self.out_labels = tuple(out_labels)
        self.in_labels = tuple(in_labels)
        self.out_shape = tuple(out_shape)
        self.in_shape = tuple(in_shape)
        self.ell = ell

    def tree_flatten(self):
        aux = (
            self.val_labels,
            self.out_labels,
            self.in_labels,
            self.out_shape,
            self.in_shape,
            self.ell,
        )
        return (self.val,), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def identity(cls, shape, dtype) -> "Struct":
        labels = tuple(range(len(shape)))
        return cls(np.ones((), dtype=dtype), (), labels, labels, shape, shape)

    @classmethod
    def from_dense(cls, arr, out_ndim: int) -> "Struct":
        """A dense block from an array of shape `out_shape + in_shape`."""
        shape = tuple(arr.shape)
        out_labels = tuple(range(out_ndim))
        in_labels = tuple(range(out_ndim, len(shape)))
        return cls(
            arr,
            out_labels + in_labels,
            out_labels,
            in_labels,
            shape[:out_ndim],
            shape[out_ndim:],
        )

    @classmethod
    def build(
        cls, val, val_labels, out_labels, in_labels, out_shape, in_shape, ell=None
    ) -> "Struct":
        """Construct, checking the invariants, then relabel canonically."""
        out = cls(val, val_labels, out_labels, in_labels, out_shape, in_shape, ell)
        out.check()
        return out.canonical()

    def check(self):
        assert len(self.out_labels) == len(self.out_shape), (
            self.out_labels,
            self.out_shape,
        )
        assert len(self.in_labels) == len(self.in_shape), (
            self.in_labels,
            self.in_shape,
        )
        assert len(set(self.out_labels)) == len(self.out_labels)
        assert len(set(self.in_labels)) == len(self.in_labels)
        assert len(set(self.val_labels)) == len(self.val_labels)
        sizes = self.sizes
        for label in self.val_labels:
            assert label in sizes, (
                label,
                self.val_labels,
                self.out_labels,
                self.in_labels,
            )
        assert tuple(self.val.shape) == tuple(sizes[label] for label in self.val_labels), (
            self.val.shape,
            self.val_labels,
            sizes,
        )
        if self.ell is None:
            assert BAND not in self.val_labels
            for k, label in enumerate(self.out_labels):
                if label in self.in_labels:
                    assert self.out_shape[k] == self.in_shape[self.in_labels.index(label)]
        else:
            assert not set(self.out_labels) & set(self.in_labels)
            assert self.ell.tmap.shape[1:] == self.out_shape, (self.ell.tmap.shape, self.out_shape)
            for l in self.ell.in_axes:
                assert self.in_labels[l] not in self.val_labels

    # ---- queries ----------------------------------------------------------------------

    @property
    def sizes(self) -> dict[int, int]:
        sizes = dict(zip(self.out_labels, self.out_shape))
        sizes.update(zip(self.in_labels, self.in_shape))
        if self.ell is not None:
            sizes[BAND] = self.ell.S
        return sizes

    @property
    def dtype(self):
        return self.val.dtype

    @property
    def ties(self) -> dict[int, int]:
        """`{out axis: in axis}` for every delta pair."""
        return {
            k: self.in_labels.index(label)
            for k, label in enumerate(self.out_labels)
            if label in self.in_labels
        }

    @property
    def group_shape(self) -> tuple[int, ...]:
        """The shape of the in axes an `Ell` points into."""
        assert self.ell is not None
        return tuple(self.in_shape[l] for l in self.ell.in_axes)

    def canonical(self) -> "Struct":
        """The same block with labels renamed to a canonical form: out axis `k` is labelled
        `k`; in axis `l` is labelled like its tied out axis, or `n_out + l`; the entry axis
        of an `Ell` keeps `BAND`. Two blocks with the same structure then have the same
        labels."""
        n_out = len(self.out_labels)
        rename = {label: k for k, label in enumerate(self.out_labels)}
        rename[BAND] = BAND
        for l, label in enumerate(self.in_labels):
            if label not in rename:
                rename[label] = n_out + l
        val_labels = tuple(rename[label] for label in self.val_labels)
        order = sorted(range(len(val_labels)), key=lambda a: val_labels[a])
        val = self.val
        if order != list(range(len(order))):
            val = val.transpose(order)
            val_labels = tuple(val_labels[a] for a in order)
        return Struct(
            val,
            val_labels,
            tuple(rename[label] for label in self.out_labels),
            tuple(rename[label] for label in self.in_labels),
            self.out_shape,
            self.in_shape,
            self.ell,
        )

    def structure_key(self):
        """Hashable description of the structure (not the values) of a canonical block."""
        c = self.canonical()
        return (
            c.val_labels,
            c.out_labels,
            c.in_labels,
            c.out_shape,
            c.in_shape,
            c.val.dtype,
            None if c.ell is None else c.ell.key,
        )

    def kind(self) -> str:
        """`"identity"`, `"scaled_identity"`, `"diagonal"`, `"dense"`, `"sparse"` (a
        row-compressed pattern; see `describe`) or `"structured"`."""
        if self.ell is not None:
            return "sparse"
        ties = self.ties
        if (
            self.out_shape == self.in_shape
            and len(ties) == len(self.out_shape)
            and all(k == l for k, l in ties.items())
        ):
            if is_unit(self.val):
                return "identity"
            if self.val_labels == ():
                return "scaled_identity"
            return "diagonal"
        if not ties and set(self.val_labels) == set(self.out_labels) | set(self.in_labels):
            return "dense"
        return "structured"

    def stored_size(self) -> int:
        """How many numbers `val` holds (the static pattern of an `Ell` is not counted)."""
        return int(np.prod(np.shape(self.val), dtype=np.int64))

    # ---- elementary transformations ---------------------------------------------------

    def with_val(self, val) -> "Struct":
        return Struct(
            val,
            self.val_labels,
            self.out_labels,
            self.in_labels,
            self.out_shape,
            self.in_shape,
            self.ell,
        )

    def map_val(self, fn) -> "Struct":
        return self.with_val(fn(self.val))

    def astype(self, dtype) -> "Struct":
        if self.val.dtype == dtype:
            return self
        return self.with_val(self.val.astype(dtype))

    def untie_out(self, k: int) -> "Struct":
        """Replace the delta on out axis `k` by an explicit identity factor in `val`."""
        label = self.out_labels[k]
        assert label in self.in_labels
        new = fresh_label()
        sizes = self.sizes
        sizes[new] = sizes[label]
        # `val` moves to the out side: off the diagonal an entry is then `0 * v`, `v` the
        # value of its row, as `jax.jacfwd` forms it (its basis's zeros times the row's
        # derivative), so that a non-finite derivative makes its row NaN, not its column.
        moved = tuple(new if x == label else x for x in self.val_labels)
        val, val_labels = contract(
            [(self.val, moved), (eye(sizes[label], self.dtype), (new, label))],
            moved + tuple(x for x in (new, label) if x not in moved),
            sizes,
        )
        if val.dtype != self.dtype:
            val = val.astype(self.dtype)
        out_labels = list(self.out_labels)
        out_labels[k] = new
        return Struct.build(
            val, val_labels, out_labels, self.in_labels, self.out_shape, self.in_shape
        )

    def broadcast_labels(self, labels) -> "Struct":
        """The same block with `val` broadcast to also carry `labels`."""
        labels = [label for label in labels if label not in self.val_labels]
        if not labels:
            return self
        val_labels = self.val_labels + tuple(labels)
        val = expand(self.val, self.val_labels, val_labels, self.sizes)
        return Struct.build(
            val,
            val_labels,
            self.out_labels,
            self.in_labels,
            self.out_shape,
            self.in_shape,
            self.ell,
        )

    def densify_out(self, axes: Sequence[int] | None = None) -> "Struct":
        """Make the given out axes (default all) plain: untied and present in `val`."""
        out = self
        if axes is None:
            axes = range(len(self.out_shape))
        for k in axes:
            if out.out_labels[k] in out.in_labels:
                out = out.untie_out(k)
            if out.out_labels[k] not in out.val_labels:
                out = out.broadcast_labels([out.out_labels[k]])
        return out

    def to_ell(self) -> "Struct":
        """The same block with its deltas moved into an `Ell` of one entry per out position
        (an `Ell` block is returned as it is)."""
        if self.ell is not None:
            return self
        ties = self.ties
        in_axes = tuple(sorted(ties.values()))
        out_of = {l: k for k, l in ties.items()}
        tmap = np.zeros((1,) + self.out_shape, np.int32)
        stride = 1
        for l in reversed(in_axes):
            k = out_of[l]
            shape = [1] * (1 + len(self.out_shape))
            shape[1 + k] = self.out_shape[k]
            tmap = tmap + np.arange(self.out_shape[k], dtype=np.int32).reshape(shape) * stride
            stride *= self.in_shape[l]
        in_labels = list(self.in_labels)
        for l in in_axes:
            in_labels[l] = fresh_label()
        return Struct.build(
            self.val,
            self.val_labels,
            self.out_labels,
            in_labels,
            self.out_shape,
            self.in_shape,
            Ell(tmap, None, in_axes),
        )

    def rows_all(self, test):
        """For each out position, whether the elementwise predicate `test` holds for every
        entry stored for it (the live ones of an `Ell`): a boolean array of shape
        `out_shape`, computed from `val` alone (no gather)."""
        s = self.broadcast_labels(self.out_labels)
        if s.ell is not None:
            s = s.broadcast_labels((BAND,))
        ok = test(jnp.asarray(s.val))
        if s.ell is not None and s.ell.mask is not None:
            live = expand(s.ell.mask, (BAND,) + s.out_labels, s.val_labels, s.sizes)
            ok = ok | ~live
        axes = tuple(k for k, label in enumerate(s.val_labels) if label not in s.out_labels)
        ok = jnp.all(ok, axis=axes)
        kept = tuple(label for label in s.val_labels if label in s.out_labels)
        return place(ok, kept, s.out_labels)

    def with_nan_rows(self, bad) -> "Struct":
        """The same block with every stored entry of the out positions where `bad` (a
        boolean array of shape `out_shape`) holds set to NaN, so that a product with it is
        NaN there whatever the vector. Every out position gets stored entries for this:
        `val` is broadcast along the out axes (an identity becomes a diagonal), and an
        `Ell`'s out positions with no live entry get their first entry made live (zero
        where `bad` does not hold)."""
        s = self.broadcast_labels(self.out_labels)
        if s.ell is not None:
            s = s.broadcast_labels((BAND,))
            mask = s.ell.full_mask()
            dead = ~mask.any(axis=0)
            if dead.any():
                revived = np.zeros_like(mask)
                revived[0] = dead
                at = expand(revived, (BAND,) + s.out_labels, s.val_labels, s.sizes)
                val = jnp.where(at, jnp.zeros((), s.dtype), s.val)
                ell = Ell(s.ell.tmap, mask | revived, s.ell.in_axes)
                s = Struct(
                    val, s.val_labels, s.out_labels, s.in_labels, s.out_shape, s.in_shape, ell
                )
        at = expand(bad, s.out_labels, s.val_labels, s.sizes)
        return s.with_val(jnp.where(at, jnp.full((), jnp.nan, s.dtype), s.val))


def _plain_add(a: Struct, b: Struct) -> Struct:
    """The sum of two blocks without an `Ell` and with the same ties."""
    a = a.canonical()
    b = b.canonical()
    labels = tuple(sorted(set(a.val_labels) | set(b.val_labels)))
    if a.val_labels == b.val_labels:
        val = a.val + b.val
    else:
        av, bv = place(a.val, a.val_labels, labels), place(b.val, b.val_labels, labels)
        if is_known(av) != is_known(bv):
            av, bv = jnp.asarray(av), jnp.asarray(bv)
        val = av + bv
        full = tuple(a.sizes[label] for label in labels)
        if tuple(val.shape) != full:
            val = np.broadcast_to(val, full) if is_known(val) else jnp.broadcast_to(val, full)
    return Struct(val, labels, a.out_labels, a.in_labels, a.out_shape, a.in_shape)
