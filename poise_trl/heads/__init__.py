"""The value heads: what maps a feature row to a predicted reward, behind one interface, in a name -> head table
(heads.py); the shared front end and ridge (probe.py), then one module per other head. Pure torch (the reference
probe's scikit-learn is imported when it fits); imports nothing else of the library but `settings`."""
