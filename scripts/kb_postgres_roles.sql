-- The roles of a team's oomguard knowledge base on PostgreSQL
-- (docs/knowledge_base.md, "Roles"). Run as the owner of the tables, once
-- they exist (the owner's first oomguard command that writes creates them:
-- `oomguard kb import --db postgresql://owner@host/db /dev/null`), e.g.
--   psql "postgresql://owner@host/db" -f scripts/kb_postgres_roles.sql
-- then give people and jobs login roles in these groups:
--   CREATE ROLE ci_jobs LOGIN PASSWORD '...' IN ROLE oomguard_job;
--   CREATE ROLE kb_browser LOGIN PASSWORD '...' IN ROLE oomguard_browser;
-- Schema migrations (a newer oomguard) need the owner: a job or the browser
-- that finds an older schema says so and changes nothing.

-- Training jobs: insert and update their incidents (an outcome replaces its
-- record), read and write the learned priors, note drops. No notes, no delete.
CREATE ROLE oomguard_job NOLOGIN;
GRANT SELECT ON schema_version TO oomguard_job;
GRANT SELECT, INSERT, UPDATE ON incidents, priors, prior_models TO oomguard_job;
GRANT INSERT ON sink_drops TO oomguard_job;

-- The browser (`oomguard kb serve`) and people's `oomguard kb` reads: read
-- everything, write only the notes on groups.
CREATE ROLE oomguard_browser NOLOGIN;
GRANT SELECT ON schema_version, incidents, priors, prior_models, sink_drops, notes TO oomguard_browser;
GRANT INSERT, UPDATE, DELETE ON notes TO oomguard_browser;
