"""The PNG panel of `rpcmp predict`: input | truth | prediction, for binary and multi-class outputs."""
import numpy as np
import torch

from rpcmp.train.predict import panel


def test_binary_panel_shows_input_truth_and_thresholded_prediction():
    x = torch.linspace(0, 1, 64 * 64).reshape(1, 64, 64)
    truth = (x > 0.5).float()
    logits = torch.where(x > 0.25, 3.0, -3.0)  # predicts more foreground than the truth
    image = panel(x, truth, logits)
    assert image.shape == (128, 3 * 128 + 2 * 2 * 2, 3) and image.dtype == np.uint8  # 64 px scaled x2, 2 px separators
    left, mid, right = image[:, :128], image[:, 132:260], image[:, 264:]
    assert left.min() == 0 and left.max() == 255  # the input is stretched to the full range
    assert set(np.unique(mid)) == {0, 255} and set(np.unique(right)) == {0, 255}
    assert (right == 255).mean() > (mid == 255).mean()  # threshold at sigmoid 0.5 = logit 0


def test_multiclass_panel_uses_argmax():
    x = torch.rand(3, 32, 32)
    truth = torch.randint(0, 4, (32, 32))
    logits = torch.nn.functional.one_hot(truth, 4).permute(2, 0, 1).float()
    image = panel(x, truth, logits)
    scale = 128 // 32
    width = 32 * scale
    mid, right = image[:, width + 2 * scale:2 * width + 2 * scale], image[:, -width:]
    np.testing.assert_array_equal(mid, right)  # a perfect prediction looks like the truth
