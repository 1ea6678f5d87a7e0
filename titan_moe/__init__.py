"""titan_moe: a compiler-centric trainer for Kimi-K3-class hybrid KDA/MLA MoE models."""
