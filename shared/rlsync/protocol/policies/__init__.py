"""The anchor policies, one module each; every module here is imported by the registry
(:func:`rlsync.protocol.policy.policy_names`), so a new policy is one new file."""
