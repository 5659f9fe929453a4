"""The three kinds of message a round sends a client: train, query (statistics without training) and
evaluate. Kept apart from the strategies that use them so that the code moving messages (a Flower
ClientApp process started per message) can name them without importing torch."""

TRAIN, QUERY, EVALUATE = "train", "query", "evaluate"
KINDS = (TRAIN, QUERY, EVALUATE)
