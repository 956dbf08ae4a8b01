"""The rewrite rules, in the order they run. A rule is a generator ``rule(graph) → Match``;
``compiler.rewrite`` checks each match numerically before applying it."""
from torchfuser.compiler.rules.gated import gated
from torchfuser.compiler.rules.linear_cross_entropy import linear_cross_entropy
from torchfuser.compiler.rules.norms import layer_norm, rms_norm
from torchfuser.compiler.rules.rope import rope

# Norms first: their weight multiply must not be taken by a later rule's operand.
RULES = (layer_norm, rms_norm, rope, gated, linear_cross_entropy)

__all__ = ["RULES"]
