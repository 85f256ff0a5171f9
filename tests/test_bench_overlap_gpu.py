"""bench overlap compares orders of the same layer: its head groups' attention is the whole attention's, bit for
bit, and its pipelined o (summed over the groups' columns) is o to rounding. Without a GPU only the CLI's
checks run."""

import json

import pytest
import torch

from pagedref.bench import overlap
from pagedref.kernels import gpu_available

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")


@pytest.mark.parametrize("argv, problem", [
    (["--groups", "3"], "--groups must divide"),
    (["--groups", "1"], "--groups must divide"),
    (["--context", "100"], "--context must be a positive multiple of 16"),
    (["--batch", "0"], "--context must be a positive multiple of 16"),
])
def test_the_cli_names_a_bad_argument(argv, problem, capsys):
    with pytest.raises(SystemExit):
        overlap.main(argv)
    assert problem in capsys.readouterr().err


def test_a_saved_run_prints_and_plots_without_a_gpu(tmp_path, capsys):
    run = {"us_per_layer": 270.0, "mJ_per_layer": 190.0, "sm_clock_mhz": 1500.0, "power_w": 690.0}
    doc = {"benchmark": "overlap", "environment": {"device": "cuda", "gpu": "H200", "torch": "2.11", "commit": "abc",
                                                   "date": "2026-12-04 13:09 UTC"},
           "args": {"model_shape": "llama-3.1-8b", "batch": 256, "context": 208, "groups": [2], "layers": 4,
                    "seconds": 1.5, "rounds": 1, "side_priority": "default"},
           "results": {"serial": [run], "pipeline 2": [dict(run, us_per_layer=289.0, mJ_per_layer=None)]}}
    saved, png = tmp_path / "overlap.json", tmp_path / "overlap.png"
    saved.write_text(json.dumps(doc))
    assert overlap.main(["--from-json", str(saved), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "270.0 µs a layer" in out and "190.0 mJ a layer" in out and "289.0 µs a layer" in out, out
    assert png.stat().st_size > 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("groups", [2, 4])
def test_the_head_groups_attention_is_the_whole_attention(groups):
    from pagedref.bench.kernel import DecodeCase

    whole = DecodeCase(batch=5, context=208, seed=3)
    whole.run()
    parts = [whole.head_group(i, groups) for i in range(groups)]
    for p in parts:
        p.run()
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([p.out for p in parts], dim=1), whole.out), (
        "a head group's attention must give the whole attention's bits for its heads: the pipeline would "
        "otherwise time a different computation")


@pytest.mark.gpu
@needs_gpu
def test_the_pipelined_layer_computes_the_serial_layers_o():
    layer = overlap.Layer("llama-3.2-1b", batch=8, context=64, groups=[2, 4], seed=4)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(8, 2048, generator=gen, device="cuda", dtype=overlap.DTYPE) * 0.1
    attn = torch.randn(8, 32 * 64, generator=gen, device="cuda", dtype=overlap.DTYPE) * 0.1
    h = torch.randn(8, 8192, generator=gen, device="cuda", dtype=overlap.DTYPE) * 0.1
    side = torch.cuda.Stream()
    want = layer.serial(x, attn, h).float()
    for g in (2, 4):
        got = layer.pipeline(g, side, x, attn, h).float()
        torch.cuda.synchronize()
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-3), (g, (got - want).abs().max().item())


@pytest.mark.gpu
@needs_gpu
def test_the_cli_times_every_variant(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    assert overlap.main(["--model-shape", "llama-3.2-1b", "--batch", "16", "--context", "32", "--layers", "1",
                         "--seconds", "0.05", "--rounds", "1", "--groups", "2", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"serial", "pipeline 2", "qkv alone", "attention alone", "o alone", "mlp alone"}
    assert all(r[0]["us_per_layer"] > 0 for r in res.values())
    assert "pipeline 2" in capsys.readouterr().out
    assert overlap.main(["--from-json", str(out)]) == 0, "a saved run replays without a GPU's work"
    assert "pipeline 2" in capsys.readouterr().out
