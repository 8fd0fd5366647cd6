"""The models of the broad suite (bench/suite.py): published configurations with random weights,
built by each library's own constructors (transformers' config classes, timm.create_model,
torchvision.models), nothing downloaded. Where a published model is over ~1.5B parameters its
width is kept and its depth cut (`layers` in the row says how many), as PyTorch's dashboard does
for its largest Hugging Face models. Dropout, drop-path and layer drop are off: their random
numbers are not eager's, and a row must be checked against eager (bench/models.py no_dropout).

Each entry: name -> Spec(suite, build, modes). `build(batch)` gives (model, inputs: dict of
keyword arguments, or a tuple of positional ones) on the CPU; `infer_inputs` drops what only a
training step takes (labels)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

TRAIN, INFER_BF16, INFER_FP32 = ("train", "bf16"), ("infer", "bf16"), ("infer", "fp32")
CNN_MODES = (TRAIN, INFER_BF16, INFER_FP32)
MODES = (TRAIN, INFER_BF16)


@dataclass
class Spec:
    suite: str                 # hf | timm | torchvision
    build: object              # (batch) -> (model, inputs)
    batch: int
    modes: tuple = MODES
    layers: int | None = None  # depth kept where the published model's was cut
    train_only_inputs: tuple = field(default=("labels",))


# -- transformers ---------------------------------------------------------------------------------

def _hf(model_cls, config_cls, inputs, **config):
    """A transformers model of `config_cls(**config)`, dropout off, with `inputs(batch, cfg)`."""
    def build(batch):
        import transformers as T
        from models import no_dropout_config
        cfg = no_dropout_config(getattr(T, config_cls)(**config))
        return getattr(T, model_cls)(cfg), inputs(batch, cfg)
    return build


def _text(seq, labels=True):
    def inputs(batch, cfg):
        ids = torch.randint(3, min(cfg.vocab_size, 30000), (batch, seq))
        return {"input_ids": ids, **({"labels": ids} if labels else {})}
    return inputs


def _seq2seq(src, tgt):
    """Source tokens, and target tokens as the decoder's inputs (an inference step has no labels
    to shift into them) and as labels."""
    def inputs(batch, cfg):
        vocab = min(cfg.vocab_size, 30000)
        target = torch.randint(3, vocab, (batch, tgt))
        return {"input_ids": torch.randint(3, vocab, (batch, src)), "decoder_input_ids": target, "labels": target}
    return inputs


def _pixels(size, labels=True, classes=1000):
    def inputs(batch, cfg):
        return {"pixel_values": torch.randn(batch, 3, size, size),
                **({"labels": torch.randint(0, classes, (batch,))} if labels else {})}
    return inputs


def _segmentation(size):
    def inputs(batch, cfg):
        return {"pixel_values": torch.randn(batch, 3, size, size),
                "labels": torch.randint(0, cfg.num_labels, (batch, size, size))}
    return inputs


def _audio(samples):
    def inputs(batch, cfg):
        return {"input_values": torch.randn(batch, samples)}
    return inputs


def _whisper(batch, cfg):
    target = torch.randint(3, 30000, (batch, 128))
    return {"input_features": torch.randn(batch, cfg.num_mel_bins, 3000), "decoder_input_ids": target,
            "labels": target}


def _clip(batch, cfg):
    return {"input_ids": torch.randint(3, cfg.text_config.vocab_size, (batch, 77)),
            "pixel_values": torch.randn(batch, 3, 224, 224), "return_loss": True}


ENC, DEC = _text(512), _text(512)
HF = {
    # encoders (masked LM heads, labels: the inputs)
    "bert_base": Spec("hf", _hf("BertForMaskedLM", "BertConfig", ENC), 16),
    "roberta_base": Spec("hf", _hf("RobertaForMaskedLM", "RobertaConfig", ENC, vocab_size=50265,
                                   max_position_embeddings=514, type_vocab_size=1, pad_token_id=1), 16),
    "deberta_v3_base": Spec("hf", _hf("DebertaV2ForMaskedLM", "DebertaV2Config", ENC, vocab_size=128100,
                                      hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072, relative_attention=True, position_buckets=256,
                                      norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
                                      max_relative_positions=-1, position_biased_input=False, type_vocab_size=0),
                            8),
    "electra_small": Spec("hf", _hf("ElectraForMaskedLM", "ElectraConfig", ENC), 32),
    "albert_base": Spec("hf", _hf("AlbertForMaskedLM", "AlbertConfig", ENC, hidden_size=768, num_attention_heads=12,
                                  intermediate_size=3072, embedding_size=128), 16),
    "distilbert_base": Spec("hf", _hf("DistilBertForMaskedLM", "DistilBertConfig", ENC), 16),
    "xlm_roberta_base": Spec("hf", _hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", ENC, vocab_size=250002,
                                       max_position_embeddings=514, type_vocab_size=1, pad_token_id=1), 8),
    # decoder-only language models (labels: the inputs, shifted by the model)
    "gpt2": Spec("hf", _hf("GPT2LMHeadModel", "GPT2Config", DEC), 8),
    "gpt_neo_125m": Spec("hf", _hf("GPTNeoForCausalLM", "GPTNeoConfig", DEC, hidden_size=768, num_layers=12,
                                   num_heads=12, attention_types=[[["global", "local"], 6]]), 8),
    "gptj_small": Spec("hf", _hf("GPTJForCausalLM", "GPTJConfig", DEC, n_embd=1024, n_layer=12, n_head=16,
                                 rotary_dim=64), 8),
    "opt_125m": Spec("hf", _hf("OPTForCausalLM", "OPTConfig", DEC), 8),
    "tinyllama_1b": Spec("hf", _hf("LlamaForCausalLM", "LlamaConfig", DEC, hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                                   vocab_size=32000), 4),
    "mistral_7b_4l": Spec("hf", _hf("MistralForCausalLM", "MistralConfig", DEC, num_hidden_layers=4), 4, layers=4),
    "qwen2_0_5b": Spec("hf", _hf("Qwen2ForCausalLM", "Qwen2Config", DEC, hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                 vocab_size=151936, tie_word_embeddings=True), 4),
    "phi3_mini_4l": Spec("hf", _hf("Phi3ForCausalLM", "Phi3Config", DEC, num_hidden_layers=4), 4, layers=4),
    "gemma_2b_6l": Spec("hf", _hf("GemmaForCausalLM", "GemmaConfig", DEC, hidden_size=2048, intermediate_size=16384,
                                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=1, head_dim=256),
                        4, layers=6),
    "pythia_160m": Spec("hf", _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", DEC, hidden_size=768, num_hidden_layers=12,
                                  num_attention_heads=12, intermediate_size=3072, vocab_size=50304,
                                  rotary_pct=0.25), 8),
    "bloom_560m": Spec("hf", _hf("BloomForCausalLM", "BloomConfig", DEC, hidden_size=1024, n_layer=24, n_head=16),
                       4),
    # encoder-decoders
    "t5_small": Spec("hf", _hf("T5ForConditionalGeneration", "T5Config", _seq2seq(256, 128), decoder_start_token_id=0),
                     16),
    "mt5_small": Spec("hf", _hf("MT5ForConditionalGeneration", "MT5Config", _seq2seq(256, 128), d_model=512,
                                d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False), 16),
    "bart_base": Spec("hf", _hf("BartForConditionalGeneration", "BartConfig", _seq2seq(256, 128), d_model=768,
                                encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072), 16),
    "pegasus_6l": Spec("hf", _hf("PegasusForConditionalGeneration", "PegasusConfig", _seq2seq(256, 128),
                                 encoder_layers=6, decoder_layers=6), 8, layers=6),
    "marian_en_de": Spec("hf", _hf("MarianMTModel", "MarianConfig", _seq2seq(256, 128), vocab_size=58101,
                                   decoder_vocab_size=58101, pad_token_id=58100, decoder_start_token_id=58100), 16),
    # vision
    "vit_base": Spec("hf", _hf("ViTForImageClassification", "ViTConfig", _pixels(224), num_labels=1000), 32),
    "deit_base": Spec("hf", _hf("DeiTForImageClassification", "DeiTConfig", _pixels(224), num_labels=1000), 32),
    "beit_base": Spec("hf", _hf("BeitForImageClassification", "BeitConfig", _pixels(224), num_labels=1000,
                                use_relative_position_bias=True), 32),
    "swin_tiny": Spec("hf", _hf("SwinForImageClassification", "SwinConfig", _pixels(224), num_labels=1000), 32),
    "convnext_tiny": Spec("hf", _hf("ConvNextForImageClassification", "ConvNextConfig", _pixels(224),
                                    num_labels=1000), 32),
    "segformer_b0": Spec("hf", _hf("SegformerForSemanticSegmentation", "SegformerConfig", _segmentation(512),
                                   num_labels=150), 8),
    "mobilevit_small": Spec("hf", _hf("MobileViTForImageClassification", "MobileViTConfig", _pixels(256),
                                      num_labels=1000), 32),
    # speech
    "whisper_base": Spec("hf", _hf("WhisperForConditionalGeneration", "WhisperConfig", _whisper, d_model=512,
                                   encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                                   decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048), 8),
    "wav2vec2_base": Spec("hf", _hf("Wav2Vec2Model", "Wav2Vec2Config", _audio(32000)), 8),
    "hubert_base": Spec("hf", _hf("HubertModel", "HubertConfig", _audio(32000)), 8),
    # text and image
    "clip_b32": Spec("hf", _hf("CLIPModel", "CLIPConfig", _clip), 32, train_only_inputs=("return_loss",)),
}


# -- timm and torchvision -------------------------------------------------------------------------

def _image(size=224):
    return lambda batch: (torch.randn(batch, 3, size, size),)


def _timm(name):
    def build(batch):
        import timm
        return timm.create_model(name, pretrained=False, drop_rate=0.0, drop_path_rate=0.0), _image()(batch)
    return build


def _tv(name, size=224, segmentation=False):
    def build(batch):
        import torchvision
        models = torchvision.models.segmentation if segmentation else torchvision.models
        kw = {"weights_backbone": None, "aux_loss": False} if segmentation else {}
        return getattr(models, name)(weights=None, **kw), _image(size)(batch)
    return build


TIMM = {f"timm_{n}": Spec("timm", _timm(n), 32, CNN_MODES) for n in (
    "resnet50", "resnext50_32x4d", "efficientnet_b0", "regnety_016", "mobilenetv3_large_100", "convnext_tiny",
    "resnet50_gn")}
TIMM.update({f"timm_{n}": Spec("timm", _timm(n), 32) for n in (
    "vit_base_patch16_224", "deit_base_patch16_224", "swin_tiny_patch4_window7_224", "maxvit_tiny_tf_224")})

TORCHVISION = {f"tv_{n}": Spec("torchvision", _tv(n), 32, CNN_MODES) for n in (
    "resnet50", "resnet152", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_1_6gf")}
TORCHVISION.update({f"tv_{n}": Spec("torchvision", _tv(n), 32) for n in ("vit_b_16", "swin_t")})
TORCHVISION["tv_deeplabv3_resnet50"] = Spec("torchvision", _tv("deeplabv3_resnet50", 512, segmentation=True), 8,
                                            CNN_MODES)


# -- a diffusion-style network: GroupNorm, SiLU, upsampling, skip connections ---------------------

class ResBlock(nn.Module):
    def __init__(self, cin, cout, temb):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(t))[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class UNet(nn.Module):
    """A DDPM-style UNet (Ho et al. 2020, CIFAR-10 widths 128-256-256-256 at 64x64): residual
    blocks with GroupNorm and SiLU, a timestep embedding, self-attention at the lowest resolution, nearest
    upsampling and skip connections between the halves."""

    def __init__(self, widths=(128, 256, 256, 256), temb=512):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(128, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        self.down, self.up, chans, c = nn.ModuleList(), nn.ModuleList(), [widths[0]], widths[0]
        for i, w in enumerate(widths):
            self.down.append(nn.ModuleList([ResBlock(c, w, temb), ResBlock(w, w, temb)]))
            c = w
            chans.append(c)
        self.mid = nn.ModuleList([ResBlock(c, c, temb), ResBlock(c, c, temb)])
        self.attn = nn.MultiheadAttention(c, 4, batch_first=True)
        for w in reversed(widths):
            self.up.append(nn.ModuleList([ResBlock(c + chans.pop(), w, temb), ResBlock(w, w, temb)]))
            c = w
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t):
        # sinusoidal, as DDPM's, in the input's dtype (the float64 twin's too)
        half = torch.exp(-torch.arange(64, device=x.device, dtype=x.dtype) * (9.21 / 64))
        e = t[:, None].to(x.dtype) * half[None]
        emb = self.temb(torch.cat([e.sin(), e.cos()], dim=1))
        h, skips = self.stem(x), []
        for i, (b1, b2) in enumerate(self.down):
            h = b2(b1(h, emb), emb)
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid[0](h, emb)
        n, c, hh, ww = h.shape
        seq = h.flatten(2).transpose(1, 2)
        h = h + self.attn(seq, seq, seq, need_weights=False)[0].transpose(1, 2).reshape(n, c, hh, ww)
        h = self.mid[1](h, emb)
        for i, (b1, b2) in enumerate(self.up):
            h = b2(b1(torch.cat([h, skips.pop()], dim=1), emb), emb)
            if i < len(self.up) - 1:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
        return self.out(h)


def _unet(batch):
    return UNet(), (torch.randn(batch, 3, 64, 64), torch.randint(0, 1000, (batch,)))


OWN = {"unet_ddpm_gn": Spec("own", _unet, 32, CNN_MODES)}

MODELS: dict[str, Spec] = {**HF, **TIMM, **TORCHVISION, **OWN}
