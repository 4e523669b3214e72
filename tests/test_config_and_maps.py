"""Method configs (validation, JSON round trip, CLI flags) and the feature-map registry."""

import json
import math

import pytest
import torch

import linearize
from linearize.cli import build_parser, dataclass_from_args
from linearize.config import LinearAttentionConfig, config_from_dict
from linearize.feature_maps import FEATURE_MAPS, build_feature_map


def test_json_round_trip():
    cfg = LinearAttentionConfig(feature_map="performer", feature_dim=32, window=8, decay="channel", layers=[3, 1], seed=5)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["method"] == "linear_attention"
    back = config_from_dict(data)
    assert back == cfg and back.layers == [1, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(feature_map="nope"), "unknown feature_map 'nope'; choose one of"),
        (dict(window=-1), "window must be an int >= 0"),
        (dict(decay="vector"), "decay must be None, 'scalar' or 'channel'"),
        (dict(layers=[]), "layers is empty"),
        (dict(layers=[-1]), "non-negative layer indices"),
        (dict(feature_map="hedgehog", feature_dim=33), "must be even"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(decay="channel", gate_rank=-1), "gate_rank must be an int >= 0"),
        (dict(decay="channel", gate_rank=2.5), "gate_rank must be an int >= 0"),
        (dict(gate_rank=16), "gate_rank 16 factors the decay gate, and there is none: pass decay"),
        (dict(output_gate=-1), "output_gate is the output gate's rank, an int >= 0"),
        (dict(output_gate=True), "output_gate is the output gate's rank, an int >= 0"),
    ],
)
def test_validation_says_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearAttentionConfig(**kwargs)


def test_decay_none_is_the_plain_sum():
    """`--decay none` (the word `linearize distill` takes to drop the linear preset's gate) means no gate
    in `linearize convert` and the Python config too, and is stored as null."""
    assert LinearAttentionConfig(decay="none") == LinearAttentionConfig()
    assert LinearAttentionConfig(decay="none").to_dict()["decay"] is None


def test_gate_rank_round_trips_and_the_full_gate_is_recorded_as_before():
    """gate_rank 0 (the full-width gate) is left out of the record, as written before the option
    existed; a low rank is kept and read back."""
    assert "gate_rank" not in LinearAttentionConfig(decay="channel").to_dict()
    low = LinearAttentionConfig(decay="channel", gate_rank=16)
    assert config_from_dict(json.loads(json.dumps(low.to_dict()))) == low
    assert config_from_dict({"method": "linear_attention", "decay": "scalar"}).gate_rank == 0
    with pytest.raises(ValueError, match="LinearAttentionConfig.gate_rank must be int"):
        config_from_dict({"method": "linear_attention", "decay": "scalar", "gate_rank": "16"})


def test_output_gate_round_trips_and_none_is_recorded_as_before():
    """output_gate 0 (none) is left out of the record, as written before the option existed; a rank is
    kept and read back."""
    assert "output_gate" not in LinearAttentionConfig(decay="channel").to_dict()
    gated = LinearAttentionConfig(decay="channel", gate_rank=16, output_gate=16)
    assert config_from_dict(json.loads(json.dumps(gated.to_dict()))) == gated
    assert config_from_dict({"method": "linear_attention"}).output_gate == 0


def test_gdn_window_round_trips_is_recorded_as_before_when_off_and_says_what_is_wrong():
    """A Gated DeltaNet conversion without a window is recorded as before the option existed (an older
    linearize still reads it); with one, window and sinks are kept and read back; bad values get named."""
    from linearize.config import GatedDeltaNetConfig

    assert not {"window", "sinks"} & set(GatedDeltaNetConfig().to_dict())
    windowed = GatedDeltaNetConfig(window=64, sinks=4)
    assert config_from_dict(json.loads(json.dumps(windowed.to_dict()))) == windowed
    assert config_from_dict({"method": "gdn"}).window == 0
    for kwargs, match in ((dict(window=-1), "window must be an int >= 0"), (dict(window=True), "window must be"),
                          (dict(sinks=2), r"sinks \(2\) join the softmax window's keys: pass window > 0"),
                          (dict(window=8, sinks=-1), "sinks must be an int >= 0"),
                          (dict(window=8, layout="qwen3_5", use_rope=False), "layout 'qwen3_5' has no softmax window")):
        with pytest.raises(ValueError, match=match):
            GatedDeltaNetConfig(**kwargs)


def test_from_dict_rejects_unknown_fields_and_methods():
    with pytest.raises(ValueError, match="unknown fields"):
        config_from_dict({"method": "linear_attention", "feature_mapp": "elu"})
    with pytest.raises(ValueError, match="unknown conversion method"):
        config_from_dict({"method": "mamba"})


def test_cli_flags_come_from_the_dataclass():
    args = build_parser().parse_args(
        ["convert", "m", "--out", "o", "--feature-map", "t2r", "--window", "16", "--layers", "0,2-4", "--decay", "scalar",
         "--feature-dim", "32", "--chunk-size", "32", "--gate-rank", "4", "--output-gate", "8"]
    )
    cfg = dataclass_from_args(LinearAttentionConfig, args)
    assert cfg == LinearAttentionConfig(feature_map="t2r", window=16, layers=[0, 2, 3, 4], decay="scalar", feature_dim=32,
                                        chunk_size=32, gate_rank=4, output_gate=8)
    defaults = dataclass_from_args(LinearAttentionConfig, build_parser().parse_args(["convert", "--out", "o"]))
    assert defaults == LinearAttentionConfig()


def test_registry_lists_every_map():
    assert set(FEATURE_MAPS) == {"elu", "relu", "t2r", "hedgehog", "performer"}


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_feature_maps_are_non_negative_with_expected_width(name):
    fm = build_feature_map(name, num_heads=3, head_dim=8)
    x = torch.randn(2, 5, 3, 8) * 3
    y = fm(x)
    expected = {"hedgehog": 16}.get(name, 8)
    assert y.shape == (2, 5, 3, expected)
    assert (y >= 0).all() and torch.isfinite(y).all()


def test_hedgehog_is_a_softmax_over_plus_minus_projection():
    fm = build_feature_map("hedgehog", num_heads=2, head_dim=4, feature_dim=6)
    with torch.no_grad():
        fm.weight.normal_()
    x = torch.randn(1, 3, 2, 4)
    y = fm(x)
    xw = torch.einsum("bthd,hdf->bthf", x, fm.weight)
    torch.testing.assert_close(y, torch.softmax(torch.cat([xw, -xw], -1), -1))
    torch.testing.assert_close(y.sum(-1), torch.ones(1, 3, 2))


def test_performer_approximates_the_softmax_kernel():
    d, m = 16, 8192
    fm = build_feature_map("performer", num_heads=1, head_dim=d, feature_dim=m, seed=3)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 1, d, generator=g) * 0.5, torch.randn(1, 6, 1, d, generator=g) * 0.5
    approx = torch.einsum("bthf,bshf->ts", fm(q.double()), fm(k.double()))
    exact = torch.exp(torch.einsum("bthd,bshd->ts", q.double(), k.double()) / math.sqrt(d))
    rel = (approx - exact).abs() / exact
    assert rel.mean() < 0.05 and rel.max() < 0.2


def test_t2r_and_hedgehog_start_near_identity():
    x = torch.randn(1, 4, 2, 8)
    t2r = build_feature_map("t2r", num_heads=2, head_dim=8)
    torch.testing.assert_close(t2r(x), torch.relu(x))


def test_custom_feature_map_registers():
    @linearize.register_feature_map("square_test")
    class Square(linearize.feature_maps.FeatureMap):
        def forward(self, x):
            return x * x

    try:
        LinearAttentionConfig(feature_map="square_test")
    finally:
        del FEATURE_MAPS["square_test"]
