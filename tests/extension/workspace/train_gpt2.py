"""Trains a tiny GPT-2 sequence classifier under torch.compile.

The e2e test opens transformers' installed modeling_gpt2.py next to this script: its
GPT2ForSequenceClassification.forward is compiled code here, so the editor shows its breaks.
"""
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=512,
                    num_labels=2, pad_token_id=0)
model = GPT2ForSequenceClassification(config)
compiled = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(10):
    input_ids = torch.randint(1, config.vocab_size, (8, 32))
    labels = torch.randint(0, config.num_labels, (8,))
    loss = compiled(input_ids=input_ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
