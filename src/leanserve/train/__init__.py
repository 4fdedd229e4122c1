"""Training tooling for leanserve's small default model: corpus and tokenizer (`data`), model config, the
batched training forward, the loop and the held-out evaluation (`trainer`)."""
