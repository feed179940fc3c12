"""Recognising rotated digits by inference: restarts of the encoder in rotated frames, kept by the ELBO."""

from __future__ import annotations

import json

import torch
from conftest import REAL_DATA_ROOT, requires_real_mnist


class _InkAtOneSpot:
    """A stand-in model whose "ELBO" is the ink at one canvas pixel: the frame that puts a digit's ink there wins."""

    def __init__(self, row: int, col: int):
        self.row, self.col = row, col

    def log_likelihood_bound(self, images, seed=None):
        return images[:, 0, self.row, self.col]


def test_the_search_keeps_the_frame_that_turns_the_digit_back():
    # catches: restarts turned the wrong way (a digit rotated by +90° searched at -90°), the argmax taken over the
    # images instead of the restarts, or the kept angle not the candidate's
    from probcaps.data import rotate
    from probcaps.experiments.rotated_recognition import counter_rotated, search_rotation

    upright = torch.zeros(3, 1, 21, 21)
    upright[:, 0, 10, 16] = 1.0                         # ink right of the centre
    turned = rotate(upright[:, 0], torch.tensor([90.0, 180.0, 270.0])).unsqueeze(1)
    kept, elbo = search_rotation(_InkAtOneSpot(10, 16), turned, torch.tensor([0.0, 90.0, 180.0, 270.0]))
    assert kept.tolist() == [90.0, 180.0, 270.0] and elbo.shape == (4, 3)
    back = counter_rotated(turned, kept)
    assert torch.allclose(back, upright, atol=1e-5)


@requires_real_mnist
def test_the_command_writes_both_readings_and_rebuilds_its_table(tmp_path, capsys, monkeypatch):
    # catches: a reading missing from the results, numbers outside [0, 1], or a table that --tables-only rebuilds
    # differently
    from probcaps.experiments import rotated_recognition

    monkeypatch.setenv("PROBCAPS_NO_REEXEC", "1")
    out = tmp_path / "rotated_recognition"
    assert rotated_recognition.main(["--checkpoints", "mnist", "--angles", "0", "90", "--n-test", "8",
                                     "--probe-train-limit", "60", "--candidate-step", "90", "--ttvi-steps", "2",
                                     "--data-dir", str(REAL_DATA_ROOT), "--results-dir", str(out), "--quiet"]) == 0
    m = json.loads((out / "rotated_recognition.json").read_text())["metrics"]
    rows = m["models"][0]["per_angle"]
    assert [r["angle"] for r in rows] == [0.0, 90.0] and m["n_candidates"] == 4 and m["baselines"] == {}
    for r in rows:
        assert all(0.0 <= r[f"{where}_{kind}_acc"] <= 1.0 for where in ("encoder", "search", "ttvi")
                   for kind in ("presence_pose", "presence"))
        assert r["ttvi_elbo_gain"] > 0  # two Adam steps on the kept frame's ELBO raise it on average
    table = (out / "rotated_recognition.md").read_text()
    assert "search + test-time VI, presences |" in table and "2 steps of free-form test-time VI" in table
    assert "raising its ELBO per image on average by `mnist` " in table
    assert rotated_recognition.main(["--tables-only", "--results-dir", str(out)]) == 0
    assert (out / "rotated_recognition.md").read_text() == table and "| 90° |" in table
