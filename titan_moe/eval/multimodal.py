"""Multimodal evaluation: held-out handwritten digits answered in text.

For each held-out digit image (data/images.py ``digits("val")``) the model scores the ten
documents ``[bos] <image> "a handwritten digit c" [eos]``, c = 0..9, by the sum of the log-probs
of their tokens, and answers with the best-scoring c. The image part is the same in all ten, so
the ranking is the captions' likelihood given the image. Accuracy is the fraction answered
right (chance: 0.1); the trainer logs it as ``mm_eval/digit_accuracy``, apart from text metrics.
"""

import torch
import torch.nn as nn
from torchtitan.components.tokenizer import BaseTokenizer

from titan_moe.data.images import digit_caption, digits
from titan_moe.data.multimodal import MultimodalPacker, batch_item, encode_document
from titan_moe.data.packing import IGNORE_INDEX
from titan_moe.model.args import VisionArgs
from titan_moe.ops.kda import CHUNK_SIZE as KDA_CHUNK_SIZE

N_CLASSES = 10


def candidate_batch(
    image: torch.Tensor, tokenizer: BaseTokenizer, vision: VisionArgs
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The ten captioned documents of one image, one padded window each."""
    documents = [encode_document([image, digit_caption(c)], tokenizer, vision)
                 for c in range(N_CLASSES)]
    longest = max(sum(len(p) if isinstance(p, list) else len(p[0]) for p in d)
                  for d in documents)
    seq_len = -(-longest // KDA_CHUNK_SIZE) * KDA_CHUNK_SIZE
    items = []
    for document in documents:
        packer = MultimodalPacker(seq_len, vision, tokenizer.pad_id)
        if list(packer.add(document)):
            raise ValueError(f"a digit document does not fit {seq_len} tokens")
        items.append(batch_item(packer.pop(), tokenizer.image_id))
    inputs = {k: torch.stack([x[k] for x, _ in items]) for k in items[0][0]}
    return inputs, torch.stack([y for _, y in items])


def caption_scores(model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor):
    """[n] summed log-probs of each row's labelled tokens."""
    logits = model(inputs["input"], inputs["doc_ids"], inputs["patches"], inputs["patch_pos"],
                   inputs["patch_image"]).float()
    keep = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))[..., 0]
    return (logp * keep).sum(-1)


@torch.no_grad()
def digit_accuracy(
    model: nn.Module, tokenizer: BaseTokenizer, vision: VisionArgs, n_images: int,
    device: torch.device,
) -> float:
    """Accuracy on the first n_images held-out digits (the model is left in training mode)."""
    model.eval()
    held_out = digits("val")[:n_images]
    correct = 0
    for image, label in held_out:
        inputs, labels = candidate_batch(image, tokenizer, vision)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        scores = caption_scores(model, inputs, labels.to(device))
        correct += int(scores.argmax()) == label
    model.train()
    return correct / len(held_out)
