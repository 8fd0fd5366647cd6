"""Tiny configurations of transformers' models (random weights, no downloads) and their inputs:
the model zoo of tests/models and bench/models.py. Each entry makes (model, inputs); a model's
loss is its own `loss` where it computes one (labels given), else the mean square of its first
output. Models that set `config.problem_type` on their first call with labels get it in the
config up front: that first call changes the model, so the next one would recompile (as under
torch.compile)."""
from __future__ import annotations

import torch

VOCAB = 99
TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


def _ids(b=2, s=7):
    return torch.randint(3, VOCAB, (b, s))


def _pixels(b=2, size=32):
    return torch.randn(b, 3, size, size)


def _zoo():
    import transformers as T
    return {
        "bert": lambda: (T.BertForSequenceClassification(T.BertConfig(
                             vocab_size=VOCAB, problem_type="single_label_classification", **TEXT)),
                         dict(input_ids=_ids(), attention_mask=torch.ones(2, 7, dtype=torch.long),
                              labels=torch.tensor([0, 1]))),
        "roberta": lambda: (T.RobertaModel(T.RobertaConfig(vocab_size=VOCAB, **TEXT)),
                            dict(input_ids=_ids())),
        "gpt2": lambda: (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)),
                         dict(input_ids=_ids())),
        "gpt2-labels": lambda: (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)),
                                dict(input_ids=(i := _ids()), labels=i)),
        "llama": lambda: (T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **TEXT)),
                          dict(input_ids=_ids())),
        "mistral": lambda: (T.MistralModel(T.MistralConfig(vocab_size=VOCAB, num_key_value_heads=2, **TEXT)),
                            dict(input_ids=_ids())),
        "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37,
                                                               num_layers=2, num_heads=4, decoder_start_token_id=0,
                                                               pad_token_id=0)),
                       dict(input_ids=_ids(), labels=_ids(s=5))),
        "distilbert": lambda: (T.DistilBertModel(T.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=37)),
                               dict(input_ids=_ids())),
        "vit": lambda: (T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, **TEXT)), dict(pixel_values=_pixels())),
        "clip": lambda: (T.CLIPModel(T.CLIPConfig(
                             text_config=dict(vocab_size=VOCAB, **TEXT),
                             vision_config=dict(image_size=32, patch_size=8, **TEXT), projection_dim=16)),
                         dict(input_ids=_ids(), pixel_values=_pixels(), return_loss=True)),
        "whisper": lambda: (T.WhisperModel(T.WhisperConfig(
                                vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                decoder_ffn_dim=37, num_mel_bins=16, max_source_positions=16,
                                max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                decoder_start_token_id=1)),
                            dict(input_features=torch.randn(2, 16, 32), decoder_input_ids=_ids(s=5))),
        "wav2vec2": lambda: (T.Wav2Vec2Model(T.Wav2Vec2Config(
                                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                 conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 8),
                                 num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                                 mask_time_prob=0.0, layerdrop=0.0)),
                             dict(input_values=torch.randn(2, 400))),
        "resnet": lambda: (T.ResNetForImageClassification(T.ResNetConfig(
                               embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3,
                               problem_type="single_label_classification")),
                           dict(pixel_values=_pixels(), labels=torch.tensor([0, 2]))),
        "convnext": lambda: (T.ConvNextModel(T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])),
                             dict(pixel_values=_pixels())),
    }


def names():
    return list(_zoo())


def make(name, seed=0, dropout=True):
    """`dropout=False`: every dropout probability 0 (generated kernels draw their own random
    numbers, so only a model without dropout equals eager bit for bit in train mode)."""
    torch.manual_seed(seed)
    model, inputs = _zoo()[name]()
    if not dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        for cfg in [model.config] + [getattr(model.config, k) for k in dir(model.config) if k.endswith("_config")]:
            for k, v in list(vars(cfg).items()) if hasattr(cfg, "__dict__") else []:
                if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
                    setattr(cfg, k, 0.0)
    return model, inputs


def loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = out[0] if not isinstance(out, torch.Tensor) else out
    return first.float().pow(2).mean()
