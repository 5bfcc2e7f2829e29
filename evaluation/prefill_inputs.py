"""The optional inputs of kvpress's ``compress`` that a press's scores may read, beyond the keys, the values and the
layer's kwargs, which every press gets: the names the registry's entries list (:attr:`.press_registry.PressEntry.reads`)
and the replay engine records for them (:mod:`.replay`). It sits below both and imports nothing."""

HIDDEN_STATES, ATTENTIONS, QUESTION = "hidden_states", "attentions", "question"
"""The layer's hidden states, its attention weights, and the question: the scores read the last prefill tokens, so
the question when it is compressed with the context (``--query-aware``; not an input the prefill records)."""
