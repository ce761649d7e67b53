"""The experiments of docs/EXPERIMENTS.md, one module per NAME (the command's first argument)."""

from sections import (agglomerative_controls, agglomerative_controls_gcide, agglomerative_lm, approx_trained,
                      copy_clustered, node_classify, sac_copy, sac_lm, speed, zoo_translate)

SECTIONS = {"agglomerative-lm": agglomerative_lm, "copy-clustered": copy_clustered,
            "approx-trained": approx_trained, "speed": speed, "sac-copy": sac_copy, "sac-lm": sac_lm,
            "node-classify": node_classify, "agglomerative-controls": agglomerative_controls,
            "agglomerative-controls-gcide": agglomerative_controls_gcide, "zoo-translate": zoo_translate}
