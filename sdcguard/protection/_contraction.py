"""One description of a GEMM: its einsum letters, which give its ``lax.dot_general`` numbers too.

Example:
  >>> ct = Contraction.parse("btd,df->btf", 3, 2)
  >>> ct.dimension_numbers
  (((2,), (0,)), ((), ()))
  >>> Contraction.from_dot_general(3, 2, ct.dimension_numbers).spec
  'bca,ad->bcd'
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Contraction:
    """A pure-contraction einsum ``lhs,rhs->out``, one letter per axis.

    Attributes:
      lhs, rhs, out: the letters of each operand's and the output's axes.
    """

    lhs: str
    rhs: str
    out: str

    @classmethod
    def parse(cls, spec: str, lhs_ndim: int, rhs_ndim: int) -> Contraction:
        """The contraction of an einsum ``spec`` (``...`` broadcast as in ``jnp.einsum``).

        Raises:
          ValueError: ``spec`` is not a two-operand pure contraction with an explicit output.
        """
        spec = spec.replace(" ", "")
        inputs, arrow, out = spec.partition("->")
        if not arrow:
            raise ValueError(f"einsum spec {spec!r} needs an explicit output ('...->...')")
        lhs, comma, rhs = inputs.partition(",")
        if not comma or "," in rhs:
            raise ValueError(f"checked einsum needs exactly two operands, got {spec!r}")
        used = set(spec) - set(".,->")
        free = [c for c in string.ascii_letters if c not in used]

        n_ell = max(
            lhs_ndim - (len(lhs) - 3) if "..." in lhs else 0,
            rhs_ndim - (len(rhs) - 3) if "..." in rhs else 0,
        )
        ellipsis = "".join(free[:n_ell])

        def expand(term: str, ndim: int) -> str:
            # Ellipsis axes align from the right: an operand with fewer takes the last ones.
            if "..." not in term:
                return term
            n = ndim - (len(term) - 3)
            return term.replace("...", ellipsis[n_ell - n :])

        lhs, rhs = expand(lhs, lhs_ndim), expand(rhs, rhs_ndim)
        out = out.replace("...", ellipsis)
        c = cls(lhs, rhs, out)
        c._validate(spec)
        return c

    @classmethod
    def from_dot_general(cls, lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> Contraction:
        """The contraction of a ``lax.dot_general`` (output: batch, lhs free, rhs free)."""
        (lc, rc), (lb, rb) = dimension_numbers
        letters = iter(string.ascii_letters)
        lhs = [""] * lhs_ndim
        rhs = [""] * rhs_ndim
        for i, j in zip(lb, rb, strict=True):
            lhs[i] = rhs[j] = next(letters)
        for i, j in zip(lc, rc, strict=True):
            lhs[i] = rhs[j] = next(letters)
        for term in (lhs, rhs):
            for i, c in enumerate(term):
                if not c:
                    term[i] = next(letters)
        batch = [lhs[i] for i in lb]
        lfree = [c for i, c in enumerate(lhs) if i not in lb and i not in lc]
        rfree = [c for i, c in enumerate(rhs) if i not in rb and i not in rc]
        return cls("".join(lhs), "".join(rhs), "".join(batch + lfree + rfree))

    def _validate(self, spec: str):
        for term in (self.lhs, self.rhs, self.out):
            if len(set(term)) != len(term):
                raise ValueError(f"checked einsum {spec!r}: repeated index within one operand")
        lone = (set(self.lhs) ^ set(self.rhs)) - set(self.out)
        extra = set(self.out) - set(self.lhs) - set(self.rhs)
        if lone or extra:
            raise ValueError(
                f"einsum {spec!r} is not a pure contraction (indices {sorted(lone | extra)} "
                "appear in one operand only); ABFT checks contractions"
            )

    @property
    def batch(self) -> str:
        """Letters of both operands and the output, in the output's order."""
        return "".join(c for c in self.out if c in self.lhs and c in self.rhs)

    @property
    def lhs_free(self) -> str:
        """Letters of the left operand and the output only, in the output's order."""
        return "".join(c for c in self.out if c in self.lhs and c not in self.rhs)

    @property
    def rhs_free(self) -> str:
        """Letters of the right operand and the output only, in the output's order."""
        return "".join(c for c in self.out if c in self.rhs and c not in self.lhs)

    @property
    def contracted(self) -> str:
        """Letters summed over, in the left operand's order."""
        return "".join(c for c in self.lhs if c in self.rhs and c not in self.out)

    @property
    def spec(self) -> str:
        """The einsum string ``'lhs,rhs->out'``."""
        return f"{self.lhs},{self.rhs}->{self.out}"

    @property
    def dimension_numbers(self):
        """``lax.dot_general``'s ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``."""
        return (
            (axes_of(self.lhs, self.contracted), axes_of(self.rhs, self.contracted)),
            (axes_of(self.lhs, self.batch), axes_of(self.rhs, self.batch)),
        )

    def in_dot_order(self) -> Contraction:
        """This contraction with its output in ``lax.dot_general``'s order.

        That is: batch, lhs free (lhs order), rhs free (rhs order).
        """
        lhs_free = "".join(c for c in self.lhs if c in self.out and c not in self.rhs)
        rhs_free = "".join(c for c in self.rhs if c in self.out and c not in self.lhs)
        return Contraction(self.lhs, self.rhs, self.batch + lhs_free + rhs_free)

    def sizes(self, a, b) -> dict[str, int]:
        """``{letter: size}`` of operands ``a`` and ``b``."""
        return {
            **dict(zip(self.lhs, a.shape, strict=True)),
            **dict(zip(self.rhs, b.shape, strict=True)),
        }

    def without(self, letters: str) -> str:
        """The output's letters without ``letters``."""
        return "".join(c for c in self.out if c not in letters)

    def grad_lhs(self) -> Contraction:
        """The backward GEMM for the left operand: ``dA = einsum(out,rhs->lhs)``."""
        return Contraction(self.out, self.rhs, self.lhs)

    def grad_rhs(self) -> Contraction:
        """The backward GEMM for the right operand: ``dB = einsum(lhs,out->rhs)``."""
        return Contraction(self.lhs, self.out, self.rhs)


def axes_of(term: str, letters: str) -> tuple[int, ...]:
    """The axes of ``term`` that ``letters`` name, in ``letters``' order."""
    return tuple(term.index(c) for c in letters)


def along(t: jax.Array, t_letters: str, letters: str, shape) -> jax.Array:
    """``t`` broadcast onto an array of ``shape`` whose axes are ``letters``.

    ``t_letters`` (a subset of ``letters``, in any order) name ``t``'s axes; the result has unit
    axes where ``t`` has no letter.
    """
    order = [c for c in letters if c in t_letters]
    t = jnp.transpose(t, [t_letters.index(c) for c in order])
    return t.reshape([shape[i] if c in t_letters else 1 for i, c in enumerate(letters)])


def unravel(flat: jax.Array, letters: str, dims: dict) -> dict[str, jax.Array]:
    """``{letter: index}`` of the row-major flat index ``flat`` over ``letters``' axes, uint32.

    Unsigned and in bounds by construction, so no gather or scatter needs a bounds check.
    """
    flat = flat.astype(jnp.uint32)
    out = {}
    for letter in reversed(letters):
        out[letter] = flat % dims[letter]
        flat = flat // dims[letter]
    return out


def gather_lines(x: jax.Array, letters: str, at: dict[str, jax.Array], kept: str) -> jax.Array:
    """``Z`` lines of ``x``, in its own layout (no transpose of ``x``).

    Args:
      x: the array, axes ``letters``.
      letters: ``x``'s letters.
      at: ``{letter: [Z] indices}`` for each letter of ``x`` not in ``kept``.
      kept: the letters of each line.

    Returns:
      ``[Z, *kept dims in x's order]``.
    """
    size = next(iter(at.values())).shape[0] if at else 1
    if not at:
        return jnp.broadcast_to(x, (size, *x.shape))
    index = tuple(at[c] if c in at else slice(None) for c in letters)
    out = x.at[index].get(mode="promise_in_bounds")
    picked = [i for i, c in enumerate(letters) if c in at]
    adjacent = picked == list(range(picked[0], picked[0] + len(picked)))
    # numpy's rule: adjacent advanced indices keep their place, separated ones go first.
    return jnp.moveaxis(out, picked[0], 0) if adjacent else out


def set_lines(x, letters: str, at: dict[str, jax.Array], kept: str, lines) -> jax.Array:
    """``x`` with the lines :func:`gather_lines` reads at ``at`` replaced by ``lines``.

    ``lines`` is ``[Z, prod(kept dims)]``; a scatter of ``Z`` lines, in place where ``x`` has no
    other use.
    """
    kept_shape = [x.shape[i] for i, c in enumerate(letters) if c in kept]
    lines = lines.reshape(lines.shape[0], *kept_shape)
    if not at:
        return lines[0]
    index = tuple(at[c] if c in at else slice(None) for c in letters)
    picked = [i for i, c in enumerate(letters) if c in at]
    if picked == list(range(picked[0], picked[0] + len(picked))):
        lines = jnp.moveaxis(lines, 0, picked[0])  # numpy's rule, as in gather_lines
    return x.at[index].set(lines, mode="promise_in_bounds", unique_indices=True)


def empty_gemm(*shapes: Sequence[int]) -> bool:
    """Whether a GEMM of operands of these shapes computes nothing: its output is empty, or
    nothing is contracted (XLA writes zeros). Such a GEMM is not checked.

    Example:
      >>> empty_gemm((0, 8), (8, 4))
      True
    """
    return any(0 in tuple(shape) for shape in shapes)
