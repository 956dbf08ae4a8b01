"""torchfuser.switches: process-wide choices set through switched(), checked, and put back."""
from __future__ import annotations

import pytest

from torchfuser import switches
from torchfuser.switches import SWITCHES, switched


def test_defaults_are_the_measured_ones():
    assert (SWITCHES.lora_split_bf16, SWITCHES.fp8_producers, SWITCHES.fp8_norm_producers,
            SWITCHES.fp8_rowwise_both) == (True, True, False, "atomic")


def test_switched_sets_and_puts_back_even_on_an_error():
    with pytest.raises(RuntimeError):
        with switched(lora_split_bf16=False, fp8_rowwise_both="pair") as s:
            assert s is SWITCHES and not SWITCHES.lora_split_bf16 and SWITCHES.fp8_rowwise_both == "pair"
            raise RuntimeError
    assert SWITCHES.lora_split_bf16 and SWITCHES.fp8_rowwise_both == "atomic"


@pytest.mark.parametrize("values, error", [
    ({"no_such_switch": True}, TypeError),
    ({"lora_split_bf16": "yes"}, TypeError),
    ({"fp8_rowwise_both": "fast"}, ValueError),
    ({"fp8_producers": False, "fp8_rowwise_both": "fast"}, ValueError),  # nothing set when one is bad
])
def test_bad_names_and_values_raise_before_any_change(values, error):
    with pytest.raises(error):
        with switched(**values):
            pass
    assert SWITCHES == switches.Switches()
    with pytest.raises((AttributeError, TypeError, ValueError)):
        for name, value in values.items():
            setattr(SWITCHES, name, value)
    SWITCHES.fp8_producers = True  # the last loop may have set a good one before the bad
    assert SWITCHES == switches.Switches()


def test_the_modules_read_the_switches_not_privates_of_their_own():
    from torchfuser.modules import fp8
    from torchfuser.modules.adapters import lora

    for module, private in ((lora, "_SPLIT_BF16"), (fp8, "_PRODUCERS"), (fp8, "_NORM_PRODUCERS")):
        assert not hasattr(module, private), f"{module.__name__}.{private} is back: use torchfuser.switches"
