# A user's training step, as a newcomer writes it: the model and batch are un-annotated
# parameters (the editor cannot know what `model` is, so calling it is no break), and the real
# breaks are the printed `.item()` and `backward()`. `clip` may as well be a number: comparing
# it is no break either.
import torch
import torch.nn.functional as F


@torch.compile
def train_step(model, batch, clip):
    logits = model(batch["input"])
    loss = F.cross_entropy(logits, batch["label"])
    if clip > 0:
        loss = loss.clamp(max=clip)
    print("loss", loss.item())
    loss.backward()
    return loss
