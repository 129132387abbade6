"""Side-by-side comparison with llama.cpp's server: GGUF export, a llama-server runner, the replay comparison."""
