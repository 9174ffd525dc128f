-- Probes: what a faithful answer to a turn must show (planted by `tapedeck synth`, carried through
-- import and export so that sessions replayed from the database keep them). JSON, see
-- recorder/FORMAT.md; NULL for recorded traffic.
ALTER TABLE requests ADD COLUMN probe_json TEXT;
