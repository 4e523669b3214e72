"""scripts/results.py builds the distill commands behind docs/reports/quality.md: the flags the real CLI parser
ends up with (later flags win) and the tokens per optimizer step its step counts are fitted with."""

import pytest

from conftest import load_script
from linearize.cli import build_parser


def _script():
    return load_script("results")


def _parsed(cmd):
    return build_parser().parse_args([*cmd[1:], "--out", "x"])


@pytest.mark.parametrize("name,seq,batch", [("lolcats", 1024, 16), ("gdn-hybrid", 1024, 16)])
def test_split_batch_keeps_tokens_per_step_and_divides_the_micro_batch(name, seq, batch):
    rs = _script()
    alone, tokens_alone = rs.base_command(name, "m", "d")
    shared, tokens_shared = rs.base_command(name, "m", "d", split_batch=2)
    a, s = _parsed(alone), _parsed(shared)
    assert (a.seq_len, a.batch_size, a.grad_accum) == (seq, batch, 1)
    assert (s.seq_len, s.batch_size, s.grad_accum) == (seq, batch // 2, 2)
    assert tokens_alone == tokens_shared == 16384


def test_split_batch_must_divide_the_batch_and_extra_flags_win():
    rs = _script()
    gdn = _parsed(rs.base_command("gdn", "m", "d")[0])
    assert gdn.max_skipped_steps == 10 and gdn.compile and gdn.cuda_graphs
    assert (gdn.stage1_steps, gdn.stage2_steps) == (300, 700)  # the stages' shares of a --max-minutes budget
    with pytest.raises(SystemExit, match="does not divide"):
        rs.base_command("lolcats", "m", "d", split_batch=3)
    cmd, tokens = rs.base_command("lolcats", "m", "d", extra="--seq-len 128 --grad-accum 3")
    assert tokens == 128 * 16 * 3 and _parsed(cmd).seq_len == 128
