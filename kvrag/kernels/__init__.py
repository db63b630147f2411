"""The invariant kernel: attention (`attention`) and linear layers (`linear`) whose every row's
bits are those of one ordinary pass, wherever a prompt is split. No other kvrag code below it.

`register()` registers the attention kernel with transformers as `invariant` (kvrag's `load_model`
does), so that a model loaded by hand with `attn_implementation="invariant"` uses it (its linear
layers need `make_linear_invariant` too). Importing this package changes nothing."""

from kvrag.kernels.attention import INVARIANT, invariant_attention, register
from kvrag.kernels.linear import ROW_BLOCK, make_linear_invariant

__all__ = ["INVARIANT", "invariant_attention", "register", "ROW_BLOCK", "make_linear_invariant"]
