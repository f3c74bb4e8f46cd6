"""Token selection, verification rules and the shared decoding bookkeeping."""
