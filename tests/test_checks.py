"""Every bad input gets a ValueError/TypeError that names the argument (both backends)."""

import pytest
import torch

import maxsim
from maxsim.reference import maxsim_reference

ENTRY_POINTS = [maxsim.maxsim, maxsim_reference]


def q(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


CASES = [
    # (args, kwargs, exception, message fragment)
    ((q(4, 16), q(4)), {}, ValueError, "D must have shape [Nd, Ld, d], [Nq, K, Ld, d] or [Ld, d]; got [4]"),
    ((q(16), q(3, 4, 16)), {}, ValueError, "Q must have shape [Nq, Lq, d] or [Lq, d]; got [16]"),
    ((q(1, 2, 3, 4), q(3, 4, 4)), {}, ValueError, "Q must have shape"),
    ((q(2, 4, 16), q(3, 5, 8)), {}, ValueError, "same embedding dim d"),
    ((q(2, 4, 16), q(3, 2, 5, 16)), {}, ValueError, "one candidate list per query (Nq=2)"),
    ((q(4, 16), q(2, 2, 5, 16)), {}, ValueError, "4-D D [Nq, K, Ld, d] needs a 3-D Q"),
    ((q(2, 4, 16), q(3, 5, 16), torch.ones(2, 5, dtype=torch.bool)), {}, ValueError, "q_mask must have shape [2, 4]; got [2, 5]"),
    ((q(2, 4, 16), q(3, 5, 16), None, torch.ones(3, 4, dtype=torch.bool)), {}, ValueError, "d_mask must have shape [3, 5]; got [3, 4]"),
    ((q(2, 4, 16), q(3, 5, 16), [[1, 0]]), {}, TypeError, "q_mask must be a torch.Tensor or None"),
    ((q(2, 4, 16, dtype=torch.float64), q(3, 5, 16, dtype=torch.float64)), {}, TypeError, "Q must be float16, bfloat16 or float32; got float64"),
    ((torch.ones(2, 4, 16, dtype=torch.int32), q(3, 5, 16)), {}, TypeError, "Q must be float16, bfloat16 or float32; got int32"),
    ((q(2, 4, 16), q(3, 5, 16, dtype=torch.float16)), {}, TypeError, "Q and D must have the same dtype; got Q float32 and D float16"),
    ((q(2, 4, 16), q(3, 5, 16)), {"mask_mode": "max"}, ValueError, "mask_mode must be 'exclude' or 'multiply'; got 'max'"),
    (([[1.0]], q(3, 5, 16)), {}, TypeError, "Q must be a torch.Tensor; got list"),
    ((q(2, 4, 0), q(3, 5, 0)), {}, ValueError, "embedding dim d must be at least 1"),
]


# Number masks with values other than 0 and 1: the reference raises; maxsim.maxsim (which must not
# wait for the GPU to look) makes those sequences' scores NaN, below.
REFERENCE_CASES = [
    ((q(2, 4, 16), q(3, 5, 16), torch.full((2, 4), 0.5)), {}, ValueError, "q_mask must be boolean"),
    ((q(2, 4, 16), q(3, 5, 16), None, torch.full((3, 5), 2)), {}, ValueError, "d_mask must be boolean"),
]


def test_a_mask_value_other_than_0_and_1_makes_that_sequence_nan():
    Q, D = q(3, 4, 16), q(5, 6, 16)
    q_mask, d_mask = torch.ones(3, 4, dtype=torch.long), torch.ones(5, 6)
    q_mask[1, 2], d_mask[3, 0] = 2, 0.5
    d_mask[0, 5] = 0  # a 0 is a masked token, not an error
    got = maxsim.maxsim(Q, D, q_mask, d_mask)
    bad = torch.zeros(3, 5, dtype=torch.bool)
    bad[1, :], bad[:, 3] = True, True
    assert torch.isnan(got[bad]).all() and not torch.isnan(got[~bad]).any()
    want = maxsim_reference(Q, D, q_mask.clamp(max=1).bool(), (d_mask == 1))
    torch.testing.assert_close(got[~bad], want[~bad])


@pytest.mark.parametrize("fn,args,kwargs,exc,fragment",
                         [(fn, *c) for fn in ENTRY_POINTS for c in CASES] + [(maxsim_reference, *c) for c in REFERENCE_CASES],
                         ids=[f"{name}-{c[3][:40]}" for name in ("maxsim", "reference") for c in CASES]
                         + [f"reference-{c[3][:40]}" for c in REFERENCE_CASES])
def test_bad_input_raises_clear_error(fn, args, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert fragment in str(info.value)
    assert str(info.value).startswith("maxsim: ")


def test_normalize_must_be_bool():
    with pytest.raises(TypeError, match="normalize must be True or False"):
        maxsim.maxsim(q(2, 4, 8), q(3, 5, 8), normalize="yes")


def test_mismatched_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="same device"):
        maxsim.maxsim(q(2, 4, 8).cuda(), q(3, 5, 8))
    with pytest.raises(ValueError, match="q_mask is on cpu"):
        maxsim.maxsim(q(2, 4, 8).cuda(), q(3, 5, 8).cuda(), torch.ones(2, 4, dtype=torch.bool))


def test_mask_on_meta_device_is_rejected():
    # A device mismatch that works without a GPU: a mask on the meta device.
    with pytest.raises(ValueError, match="q_mask is on meta"):
        maxsim.maxsim(q(2, 4, 8), q(3, 5, 8), torch.ones(2, 4, dtype=torch.bool, device="meta"))


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("MAXSIM_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="MAXSIM_BACKEND must be one of auto, triton, reference"):
        maxsim.maxsim(q(2, 4, 8), q(3, 5, 8))
