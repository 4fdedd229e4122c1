"""DeepSeek-V4 chat: the prompt format, the output parser, and which chat format a model uses."""
