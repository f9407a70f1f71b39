"""A policy's replicas as one thing: the pool (``pool.EnginePool``), the in-process factory
(``factory``) and the one owner of pause / sleep / wake / push per policy (``policy.PolicyReplicas``).
Imports the other rollout subpackages and layers 0-1."""
