"""Client-level differential privacy for the strategies that aggregate clipped uploads by summing them
(McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018):

    clipping    each client's whole upload scaled to L2 norm <= C, on the client (`clipping`)
    noise       Gaussian N(0, σ²C²) on every sum the strategy aggregates, drawn on the server or as shares
                N(0, σ²C²/h) by the h contributors of each sum (`noise`)
    accounting  ε at δ after each round by Google's dp-accounting, the sampling modelled as the run samples
                (`accountant`)
    settings    the run's DP options resolved and checked, refusals included (`settings`)
    hooks       what a supporting strategy declares (`hooks.ClientPrivacy`); `upload` applies them on a client

The modules import nothing heavy at package import, so strategies can derive from the hook cheaply.
"""
