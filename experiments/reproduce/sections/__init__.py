"""The experiments of docs/EXPERIMENTS.md, one module per NAME (the command's first argument)."""

from sections import (agglomerative_controls, agglomerative_controls_gcide, agglomerative_lm, approx_trained,
                      cloze_long, copy_clustered, copy_long, extrapolation, lookup, mixed_precision, modern_block,
                      node_classify, node_controls, sac_controls, sac_copy, sac_copy_entropy, sac_lm, speed,
                      zoo_translate)

SECTIONS = {"agglomerative-lm": agglomerative_lm, "agglomerative-controls": agglomerative_controls,
            "agglomerative-controls-gcide": agglomerative_controls_gcide,
            "copy-clustered": copy_clustered, "copy-long": copy_long, "approx-trained": approx_trained,
            "cloze-long": cloze_long, "lookup": lookup, "mixed-precision": mixed_precision, "speed": speed,
            "sac-copy": sac_copy, "sac-copy-entropy": sac_copy_entropy, "sac-lm": sac_lm,
            "sac-controls": sac_controls, "node-classify": node_classify, "node-controls": node_controls,
            "zoo-translate": zoo_translate, "extrapolation": extrapolation, "modern-block": modern_block}
