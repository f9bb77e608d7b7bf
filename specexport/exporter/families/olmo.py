"""OLMo 2 and 3: post-norms only (each block's output is normed before the residual add, no input norm) and q/k
RMSNorm over the whole projection; OLMo 3 adds sliding layers (`layer_types`)."""

from specexport.exporter.families import POST_NORMS, Family, register

register(Family("olmo2", norms=dict(POST_NORMS), qk_norm="full"),
         Family("olmo3", norms=dict(POST_NORMS), qk_norm="full"))
