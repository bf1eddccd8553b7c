"""Privacy: accountants (one class each), calibration, the run's plan, the secure-aggregation checks, private
tuning's selection accounting, the guarantee's text and the empirical auditor. No Flower import.

The mechanisms themselves (what is added: the sensitivity bounds, noise placements and noise laws) are in
`dpfedavg.core`. Nothing is imported here, so that the config can read the accountants' names
without loading dp-accounting.
"""
