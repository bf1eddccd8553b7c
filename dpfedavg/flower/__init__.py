"""Every module that imports Flower: the ClientApp and ServerApp, the strategy, the message schema, the reply
checks, the federation and the secure-aggregation glue, and an in-process Grid for tests.

Nothing is imported here, so that importing one of these modules loads only what it needs.
"""
