"""HTTP emulators of the cloud providers' REST APIs (see base.py), one module each."""
