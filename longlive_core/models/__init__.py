"""Models: the causal Wan2.2-TI2V-5B DiT (``wan_dit``), its configs by name (``config``), attention
behind one interface with one mask definition (``attention``), 3-D RoPE (``rope``) and weight
loading from local directories in either published layout (``checkpoint``)."""
