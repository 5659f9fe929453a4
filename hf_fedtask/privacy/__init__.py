"""Client-level differential privacy for the strategies that aggregate clipped uploads by summing them
(McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018):

    clipping    each client's whole upload scaled to L2 norm <= C, on the client (`clipping`)
    noise       Gaussian N(0, σ²C²) on every sum the strategy aggregates, drawn on the server or as shares
                N(0, σ²C²/h) by the h contributors of each sum, from a ChaCha20 keystream (`noise`)
    sampling    each round's client sample drawn from secret randomness, never the public run seed (`sampling`)
    accounting  ε at δ after each round by Google's dp-accounting, every round at the σ it used (`accountant`)
    settings    the run's DP options resolved and checked, refusals included (`settings`)
    hooks       what a supporting strategy declares (`hooks.ClientPrivacy`); `upload` applies them on a client
    server      the server's wrapper around a strategy's aggregation: sample, σ, noise, accountant (`server`)
    report      results.json's entry, the model card's section, the round record's private part (`report`)

The modules import nothing heavy at package import, so strategies can derive from the hook cheaply.
"""
