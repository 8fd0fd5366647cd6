import torch


# fuselens: example(x=float32[4096], w=float32[4096])
@torch.compile
def gelu_scale(x, w):
    y = 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
    print("scale", w.shape)
    return y * w


# fuselens: example(x=float32[64, 128])
@torch.compile
def centered_softmax(x):
    if x.sum() > 0:
        x = x - x.mean()
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)
