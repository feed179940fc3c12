from pathlib import Path

import numpy as np
import pytest
import torch

from probcaps.plotting import (
    PART_PALETTE,
    colour_parts,
    plot_curve_panels,
    plot_curves,
    plot_heatmap,
    plot_image_grid,
    plot_reconstructions,
    plot_templates,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path, tmp_path, min_bytes=1000):
    assert path.exists()
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes
    # atomic write: no temporary files left beside it
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_plot_templates_with_and_without_alphas(tmp_path):
    g = torch.Generator().manual_seed(0)
    templates = torch.rand(5, 1, 11, 11, generator=g)
    p = plot_templates(templates, tmp_path / "t.png", title="templates")
    _assert_png(p, tmp_path)
    p2 = plot_templates(templates[:, 0].numpy(), tmp_path / "nested" / "ta.png", alphas=torch.rand(5, 11, 11), ncols=3)
    _assert_png(p2, tmp_path)
    with pytest.raises(ValueError, match="alphas"):
        plot_templates(templates, tmp_path / "bad.png", alphas=torch.rand(4, 11, 11))
    with pytest.raises(ValueError, match="templates"):
        plot_templates(torch.rand(11, 11), tmp_path / "bad.png")


def test_colour_parts_single_active_part_gives_its_colour():
    N, M, H, W = 2, 4, 6, 6
    weights = torch.zeros(N, M, H, W)
    weights[1, 2, 1:3, 2:5] = 1.0
    rgb = colour_parts(weights)
    assert rgb.shape == (N, H, W, 3)
    np.testing.assert_allclose(rgb[1, 1:3, 2:5], np.broadcast_to(PART_PALETTE[2], (2, 3, 3)))
    mask = np.zeros((H, W), bool)
    mask[1:3, 2:5] = True
    assert np.all(rgb[1][~mask] == 0) and np.all(rgb[0] == 0)
    # custom palette cycles over parts; sum is clipped to [0, 1]
    colours = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    w = np.zeros((1, 3, 2, 2))
    w[0, 2, 0, 0] = 0.5  # part 2 -> colours[0]
    w[0, 0, 1, 1] = 3.0  # overbright -> clipped
    w[0, 1, 1, 1] = 1.0
    out = colour_parts(w, colours=colours)
    np.testing.assert_allclose(out[0, 0, 0], [0.5, 0.0, 0.0])
    np.testing.assert_allclose(out[0, 1, 1], [1.0, 1.0, 0.0])
    assert out.min() >= 0 and out.max() <= 1
    with pytest.raises(ValueError, match="weights"):
        colour_parts(np.zeros((3, 4, 4)))
    with pytest.raises(ValueError, match="colours"):
        colour_parts(w, colours=np.zeros((2, 4)))


def test_plot_reconstructions(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((4, 28, 28))
    r = torch.rand(4, 1, 28, 28)
    parts = colour_parts(rng.random((4, 3, 28, 28)) * 0.3)
    _assert_png(plot_reconstructions(x, r, tmp_path / "r.png"), tmp_path)
    _assert_png(plot_reconstructions(x, r, tmp_path / "rp.png", part_colours=parts, title="epoch 1"), tmp_path)
    with pytest.raises(ValueError, match="recons"):
        plot_reconstructions(x, r[:3], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="part_colours"):
        plot_reconstructions(x, r, tmp_path / "bad.png", part_colours=parts[..., 0])


def test_plot_curves(tmp_path):
    x = np.arange(10)
    curves = {
        "train": (x, np.exp(-x / 3.0) + 0.01),
        "angle acc": (torch.arange(10.0), torch.linspace(0.9, 0.5, 10), np.full(10, 0.02)),
    }
    _assert_png(plot_curves(curves, tmp_path / "c.png", "step", "loss", title="t", logy=True), tmp_path)
    curves = {"many": (np.arange(500), np.random.default_rng(0).random(500))}
    _assert_png(plot_curves(curves, tmp_path / "m.png", "x", "y"), tmp_path)
    with pytest.raises(ValueError, match="curves"):
        plot_curves({}, tmp_path / "bad.png", "x", "y")
    with pytest.raises(ValueError, match="train"):
        plot_curves({"train": (x, x[:5])}, tmp_path / "bad.png", "x", "y")

    with pytest.raises(ValueError, match="yerr"):
        plot_curves({"train": (x, x, x[:3])}, tmp_path / "bad.png", "x", "y")
    assert not (tmp_path / "bad.png").exists()


def test_plot_curve_panels(tmp_path):
    x = np.arange(13) * 15.0
    panels = [
        {"curves": {"loss": (np.arange(200), np.exp(-np.arange(200) / 50.0))}, "xlabel": "step", "ylabel": "loss",
         "title": "training loss", "logy": True},
        {"curves": {"LeNet-5": (x, np.linspace(99, 20, 13), np.full(13, 1.5)), "CapsNet": (x, np.linspace(99, 30, 13))},
         "references": {"numpy reproduction, LeNet-5": ([0, 35], [98.7, 76.1])},
         "colours": {"LeNet-5": "C0", "numpy reproduction, LeNet-5": "C0"},
         "vlines": [35], "ylim": (0, 101), "xlabel": "angle", "ylabel": "accuracy (%)"},
    ]
    _assert_png(plot_curve_panels(panels, tmp_path / "p.png"), tmp_path)
    _assert_png(plot_curve_panels(panels * 2, tmp_path / "four.png"), tmp_path)  # wraps onto two rows
    bad = dict(panels[1])
    with pytest.raises(ValueError, match="panels"):
        plot_curve_panels([], tmp_path / "bad.png")
    with pytest.raises(ValueError, match=r"panels\[1\]\['curves'\]\['CapsNet'\]"):
        plot_curve_panels([panels[0], {**bad, "curves": {"CapsNet": (x, x[:4])}}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="references"):
        plot_curve_panels([{**bad, "references": {"ref": ([0, 35], [1.0])}}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="ylim"):
        plot_curve_panels([{**bad, "ylim": (101, 0)}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="colours"):
        plot_curve_panels([{**bad, "colours": {"LeNet-5": "not a colour"}}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="ylabel"):
        plot_curve_panels([{"curves": panels[0]["curves"], "xlabel": "step"}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="unknown keys.*xlabl"):
        plot_curve_panels([{**panels[0], "xlabl": "typo"}], tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_plot_heatmap(tmp_path):
    values = torch.rand(6, 10, generator=torch.Generator().manual_seed(0))
    p = plot_heatmap(values, tmp_path / "h.png", col_labels=[str(k) for k in range(10)], xlabel="class",
                     ylabel="image", title="lengths", vmin=0, vmax=1, outlined=[(0, 3), (5, 9)],
                     marked=[(0, 3), (1, 4)], marked_label="predicted")
    _assert_png(p, tmp_path)
    _assert_png(plot_heatmap(np.arange(12.0).reshape(3, 4), tmp_path / "plain.png", row_labels=list("abc"),
                             colorbar_label="presence", cmap="magma"), tmp_path)
    with pytest.raises(ValueError, match="values"):
        plot_heatmap(np.zeros(5), tmp_path / "bad.png")
    with pytest.raises(ValueError, match="row_labels"):
        plot_heatmap(values, tmp_path / "bad.png", row_labels=["a"])
    with pytest.raises(ValueError, match="col_labels"):
        plot_heatmap(values, tmp_path / "bad.png", col_labels=["a"] * 9)
    with pytest.raises(ValueError, match="vmin"):
        plot_heatmap(values, tmp_path / "bad.png", vmin=1, vmax=0)
    with pytest.raises(ValueError, match="outlined"):
        plot_heatmap(values, tmp_path / "bad.png", outlined=[(6, 0)])
    with pytest.raises(ValueError, match="marked"):
        plot_heatmap(values, tmp_path / "bad.png", marked=[1, 2, 3])
    with pytest.raises(ValueError, match="cmap"):
        plot_heatmap(values, tmp_path / "bad.png", cmap="no-such-map")
    assert not (tmp_path / "bad.png").exists()

def test_plot_image_grid(tmp_path):
    imgs = torch.rand(2, 3, 10, 10)
    p = plot_image_grid(imgs, tmp_path / "g.png", row_labels=["a", "b"], col_labels=["0", "45", "90"], title="grid")
    _assert_png(p, tmp_path)
    _assert_png(plot_image_grid(np.random.default_rng(0).random((1, 2, 8, 8, 3)), tmp_path / "rgb.png"), tmp_path)
    with pytest.raises(ValueError, match="row_labels"):
        plot_image_grid(imgs, tmp_path / "bad.png", row_labels=["a"])
    with pytest.raises(ValueError, match="images"):
        plot_image_grid(torch.rand(3, 10, 10), tmp_path / "bad.png")


def test_png_decodes_to_expected_image(tmp_path):
    import matplotlib.image as mpimg

    p = plot_image_grid(np.ones((1, 1, 5, 5)), tmp_path / "one.png")
    img = mpimg.imread(str(p))
    assert img.ndim == 3 and img.shape[0] > 20 and img.shape[1] > 20


def test_plotting_does_not_select_a_global_backend(tmp_path):
    # A caller's explicit backend choice survives importing and using the module.
    import subprocess
    import sys

    code = (
        "import matplotlib; matplotlib.use('svg');"
        "import probcaps.plotting as p, numpy as np;"
        f"p.plot_curves({{'a': (np.arange(3), np.arange(3))}}, {str(tmp_path / 'c.png')!r}, 'x', 'y');"
        "import matplotlib.pyplot as plt;"
        "assert matplotlib.get_backend().lower() == 'svg', matplotlib.get_backend()"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_SIGNATURE


def test_plot_predicted_vs_true(tmp_path):
    # catches: a scatter figure that is not written, or mismatched names / scores accepted silently
    from probcaps.plotting import plot_predicted_vs_true

    pred, true = torch.randn(50, 4), torch.randn(50, 4)
    out = plot_predicted_vs_true(pred, true, list("abcd"), tmp_path / "s.png", "t", scores=[0.1, 0.2, 0.3, 0.4])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="names"):
        plot_predicted_vs_true(pred, true, list("abc"), tmp_path / "bad.png")
    with pytest.raises(ValueError, match="scores"):
        plot_predicted_vs_true(pred, true, list("abcd"), tmp_path / "bad.png", scores=[1.0])
    with pytest.raises(ValueError, match="pred and true"):
        plot_predicted_vs_true(pred, true[:, :3], list("abcd"), tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_reconstructions_take_a_row_coloured_by_object(tmp_path):
    # catches: the objects' row dropped, or accepted without the parts' row it follows
    from probcaps.plotting import plot_reconstructions

    x = np.random.default_rng(0).random((3, 8, 8))
    rgb = np.zeros((3, 8, 8, 3))
    path = plot_reconstructions(x, x, tmp_path / "r.png", part_colours=rgb, object_colours=rgb)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="object_colours"):
        plot_reconstructions(x, x, tmp_path / "s.png", object_colours=rgb)
