"""Text + images through run_train.sh on CPU, FSDP over 2 gloo processes (the vision tower its
own FSDP unit): a user's jsonl folder with a missing and a corrupt image trains on without
stopping, the skips are counted in TensorBoard, and the digit eval is logged apart from the text
metrics at its evaluation step."""

import json
import os
import subprocess
from pathlib import Path

from .conftest import write_png

REPO = Path(__file__).resolve().parents[2]


def test_multimodal_training_skips_bad_images_and_logs_the_digit_eval(tmp_path, scalars_of):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        write_png(images / f"img{i}.png", 28 * (i + 1), 56, seed=i)
    (images / "corrupt.png").write_bytes(b"not an image at all")
    lines = [{"image": f"img{i}.png", "text": f"random picture {i}"} for i in range(4)]
    lines += [{"image": "missing.png", "text": "gone"}, {"image": "corrupt.png", "text": "bad"}]
    (images / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n"
                            for i in range(8)))
    env = {**os.environ, "CONFIG_FILE": "configs/debug_mm.toml", "NGPU": "2"}
    env.pop("LOCAL_RANK", None)
    overrides = [
        "--job.dump_folder", str(tmp_path / "run"), "--training.device", "cpu",
        "--training.dataset_path", str(text), "--training.image_data", str(images),
        "--training.image_docs_per_text_doc", "3",
        "--training.steps", "2", "--training.local_batch_size", "2", "--training.seq_len", "64",
        "--titan_moe.n_layers", "2", "--titan_moe.mla_layers", "2",
        "--multimodal_eval.freq", "2", "--multimodal_eval.images", "3",
        "--metrics.log_freq", "1", "--metrics.disable_color_printing",
    ]
    result = subprocess.run(["bash", "run_train.sh", *overrides], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "skipping image document" in log and "Training completed" in log

    (run_dir,) = (tmp_path / "run" / "tb").iterdir()
    skipped = scalars_of(run_dir, "data/images_skipped")
    read = scalars_of(run_dir, "data/images_read")
    assert [s for s, _ in skipped] == [1, 2] and skipped[-1][1] >= 1
    assert skipped[-1][1] <= read[-1][1]
    (accuracy,) = scalars_of(run_dir, "mm_eval/digit_accuracy")
    assert accuracy[0] == 2 and accuracy[1] in (0.0, 1 / 3, 2 / 3, 1.0)
