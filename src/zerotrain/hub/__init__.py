"""Models in and out of zerotrain: load_model / load_tokenizer and export to Hugging Face or safetensors."""
