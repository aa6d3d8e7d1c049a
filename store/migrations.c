/*
 * The numbered schema migrations. Append only: a migration that shipped is
 * never edited, a change is a new entry. store_migrate() applies those not
 * yet recorded in schema_migrations, all in one transaction.
 *
 * The append and projection logic lives here, in SQL functions, so that one
 * append is one round trip (see store/append.c) and the projection rules
 * are versioned with the tables they write.
 */
#include "store_int.h"

/*
 * The batch fold (kscore_record_many), written once for both of its uses:
 * FOLD_EXPRS(P) is the row after a command's folded events (summary s,
 * see store/fold.c) are applied to its prior state P, in the order of
 * FOLD_COLS. These are kscore_project()'s rules over a sequence: a
 * terminal status is final (a terminal P keeps its status, attempt,
 * agent, times), the first result is kept.
 */
/* A batch's status at its end, as the SQL of a migration knows it
 * (re-defined by migration 13, as FOLD_TERMINAL_LIST below is). */
#define BATCH_END_STATUS                                                       \
    "CASE p_type WHEN 'BatchCompleted' THEN 'Completed'\n"                     \
    "               ELSE 'Cancelled' END"
/* The terminal statuses as the SQL of a migration knows them: re-defined
 * before each migration that changes the set, so a shipped migration's
 * text never changes (macros expand where they are used). */
#define FOLD_TERMINAL_LIST                                                     \
    "Succeeded,Failed,TimedOut,StartFailed,Cancelled,Undeliverable,Lost"
#define FOLD_TERM "'{" FOLD_TERMINAL_LIST "}'::text[]"
#define FOLD_OPEN(P) "NOT (" P ".status = ANY (" FOLD_TERM "))"
#define FOLD_RES(P, x, col)                                                    \
    "CASE WHEN " P ".result IS NULL AND s.res IS NOT NULL THEN s." x          \
    " ELSE " P "." col " END"
#define FOLD_COLS                                                              \
    "status, agent_id, attempt, dispatched_at, deliver_by, started_at,"       \
    " finished_at, exit_code, signal, timed_out, stdout, stderr,"             \
    " stdout_total, stderr_total, stdout_truncated, stderr_truncated,"        \
    " duration_us, start_stage, start_errno, result"
#define FOLD_R_COLS                                                            \
    "r.status, r.agent_id, r.attempt, r.dispatched_at, r.deliver_by,"         \
    " r.started_at, r.finished_at, r.exit_code, r.signal, r.timed_out,"       \
    " r.stdout, r.stderr, r.stdout_total, r.stderr_total,"                    \
    " r.stdout_truncated, r.stderr_truncated, r.duration_us,"                 \
    " r.start_stage, r.start_errno, r.result"
#define FOLD_EXPRS(P)                                                          \
    "CASE WHEN " FOLD_OPEN(P) " THEN coalesce(s.st, " P ".status)"            \
    " ELSE " P ".status END,\n"                                                \
    "CASE WHEN " FOLD_OPEN(P) " THEN coalesce(s.agent, " P ".agent_id)"       \
    " ELSE " P ".agent_id END,\n"                                              \
    "CASE WHEN " FOLD_OPEN(P) " THEN coalesce(nullif(s.att, 0), " P           \
    ".attempt) ELSE " P ".attempt END,\n"                                      \
    "CASE WHEN " FOLD_OPEN(P) " AND s.disp IS NOT NULL"                       \
    " THEN kscore_ts(s.disp) ELSE " P ".dispatched_at END,\n"                  \
    "CASE WHEN " FOLD_OPEN(P) " AND s.deliver IS NOT NULL"                    \
    " THEN kscore_ts(s.deliver) ELSE " P ".deliver_by END,\n"                  \
    "CASE WHEN " FOLD_OPEN(P) " AND s.run IS NOT NULL"                        \
    " THEN coalesce(kscore_ts(s.run), kscore_ts(s.started_after))"            \
    " ELSE coalesce(" P ".started_at, kscore_ts(s.started_any)) END,\n"        \
    "CASE WHEN " FOLD_OPEN(P) " AND s.st = ANY (" FOLD_TERM ")"               \
    " THEN kscore_ts(s.fin) ELSE " P ".finished_at END,\n"                     \
    FOLD_RES(P, "r_exit", "exit_code") ",\n"                                   \
    FOLD_RES(P, "r_signal", "signal") ",\n"                                    \
    FOLD_RES(P, "r_timed_out", "timed_out") ",\n"                              \
    FOLD_RES(P, "r_stdout", "stdout") ",\n"                                    \
    FOLD_RES(P, "r_stderr", "stderr") ",\n"                                    \
    FOLD_RES(P, "r_stdout_total", "stdout_total") ",\n"                        \
    FOLD_RES(P, "r_stderr_total", "stderr_total") ",\n"                        \
    FOLD_RES(P, "r_stdout_trunc", "stdout_truncated") ",\n"                    \
    FOLD_RES(P, "r_stderr_trunc", "stderr_truncated") ",\n"                    \
    FOLD_RES(P, "r_duration", "duration_us") ",\n"                             \
    FOLD_RES(P, "r_stage", "start_stage") ",\n"                                \
    FOLD_RES(P, "r_errno", "start_errno") ",\n"                                \
    FOLD_RES(P, "res", "result")
/* The fold's summary rows, one per command (store/fold.c fills them). */
#define FOLD_SUMMARY                                                           \
    "unnest(c_id, c_last, c_req, c_agent0, c_argv_lo, c_argv_hi, c_batch,"    \
    " c_idem, c_oper, c_req_at, c_req_deliver, c_st, c_st_first,"             \
    " c_st_change, c_att, c_agent, c_disp, c_deliver, c_run,"                 \
    " c_started_after, c_started_any, c_fin, c_res, c_exit, c_signal,"        \
    " c_timed_out, c_stdout, c_stderr, c_stdout_total, c_stderr_total,"       \
    " c_stdout_trunc, c_stderr_trunc, c_duration, c_stage, c_errno)"          \
    " AS s(cid, last_ord, req, agent0, argv_lo, argv_hi, batch, idem, oper,"  \
    " req_at, req_deliver, st, st_first, st_change, att, agent, disp,"        \
    " deliver, run, started_after, started_any, fin, res, r_exit, r_signal,"  \
    " r_timed_out, r_stdout, r_stderr, r_stdout_total, r_stderr_total,"       \
    " r_stdout_trunc, r_stderr_trunc, r_duration, r_stage, r_errno)"

/*
 * The wake-up of store_wait_notify() up to migration 7: every append
 * NOTIFYed kscore_events in its transaction. PostgreSQL serializes the
 * commits of notifying transactions, WAL flush included (async.c
 * PreCommit_Notify takes a cluster-wide lock held until after commit), so
 * no two appends could share an fsync. Migration 7 re-creates the
 * functions with KS_NOTIFY empty.
 */
#define KS_NOTIFY "  PERFORM pg_notify('kscore_events', '');\n"

#define SQL_APPEND(CREATE) \
    CREATE " FUNCTION kscore_append(p_stream text, p_expected bigint,\n" \
    "  p_ids uuid[], p_types text[], p_data bytea[])\n" \
    "RETURNS bigint LANGUAGE plpgsql AS $$\n" \
    "DECLARE n int := cardinality(p_ids); v bigint;\n" \
    "BEGIN\n" \
    "  IF p_expected = -1 THEN\n" \
    "    INSERT INTO streams AS s VALUES\n" \
    "      (p_stream, split_part(p_stream, '-', 1), n)\n" \
    "      ON CONFLICT (stream_id) DO UPDATE SET version = s.version + n\n" \
    "      RETURNING s.version INTO v;\n" \
    "  ELSIF p_expected = 0 THEN\n" \
    "    INSERT INTO streams VALUES\n" \
    "      (p_stream, split_part(p_stream, '-', 1), n)\n" \
    "      ON CONFLICT (stream_id) DO NOTHING RETURNING version INTO v;\n" \
    "  ELSE\n" \
    "    UPDATE streams SET version = version + n\n" \
    "      WHERE stream_id = p_stream AND version = p_expected\n" \
    "      RETURNING version INTO v;\n" \
    "  END IF;\n" \
    "  IF EXISTS (SELECT 1 FROM events WHERE event_id = ANY (p_ids)) THEN\n" \
    "    PERFORM kscore_raise_recorded(p_stream, p_ids);\n" \
    "  END IF;\n" \
    "  IF v IS NULL THEN\n" \
    "    SELECT version INTO v FROM streams WHERE stream_id = p_stream;\n" \
    "    RAISE EXCEPTION 'stream % is at version %, expected %',\n" \
    "      p_stream, coalesce(v, 0), p_expected USING ERRCODE = 'KS001';\n" \
    "  END IF;\n" \
    "  INSERT INTO events (stream_id, version, event_id, type, data)\n" \
    "    SELECT p_stream, v - n + u.o, u.id, u.t, u.d\n" \
    "    FROM unnest(p_ids, p_types, p_data) WITH ORDINALITY AS u(id, t, d, o)\n" \
    "    ORDER BY u.o;\n" \
    KS_NOTIFY \
    "  RETURN v;\n" \
    "END $$;\n" \

#define SQL_APPEND_MANY(CREATE) \
    CREATE " FUNCTION kscore_append_many(p_ids uuid[], p_streams text[],\n" \
    "  p_types text[], p_data bytea[])\n" \
    "RETURNS bigint LANGUAGE plpgsql AS $$\n" \
    "DECLARE inserted bigint;\n" \
    "BEGIN\n" \
    "  WITH input AS (\n" \
    "    SELECT u.* FROM unnest(p_ids, p_streams, p_types, p_data)\n" \
    "      WITH ORDINALITY AS u(id, s, t, d, o)\n" \
    /* = ANY probes the index per id; an anti join would scan events. */ \
    "  ), recorded AS (\n" \
    "    SELECT e.event_id FROM events e WHERE e.event_id = ANY (p_ids)\n" \
    "  ), fresh AS (\n" \
    "    SELECT DISTINCT ON (i.id) i.* FROM input i\n" \
    "    WHERE NOT EXISTS (SELECT 1 FROM recorded r WHERE r.event_id = i.id)\n" \
    "    ORDER BY i.id, i.o\n" \
    "  ), counts AS (\n" \
    "    SELECT f.s, count(*) AS n FROM fresh f GROUP BY f.s\n" \
    "  ), bumped AS (\n" \
    "    INSERT INTO streams AS st\n" \
    "      SELECT c.s, split_part(c.s, '-', 1), c.n FROM counts c\n" \
    "      ORDER BY c.s\n" \
    "    ON CONFLICT (stream_id) DO UPDATE\n" \
    "      SET version = st.version + excluded.version\n" \
    "    RETURNING st.stream_id, st.version\n" \
    "  )\n" \
    "  INSERT INTO events (stream_id, version, event_id, type, data)\n" \
    "    SELECT f.s, b.version - c.n\n" \
    "             + row_number() OVER (PARTITION BY f.s ORDER BY f.o),\n" \
    "           f.id, f.t, f.d\n" \
    "    FROM fresh f JOIN bumped b ON b.stream_id = f.s\n" \
    "                 JOIN counts c ON c.s = f.s\n" \
    "    ORDER BY f.o;\n" \
    "  GET DIAGNOSTICS inserted = ROW_COUNT;\n" \
    "  IF inserted > 0 THEN\n" \
    "  " KS_NOTIFY \
    "  END IF;\n" \
    "  RETURN cardinality(p_ids) - inserted;\n" \
    "END $$;\n" \

/* An events insert that met recorded ids: KS003 with DETAIL = their ids,
 * comma-separated (any other unique violation is raised as it is). */
#define FOLD_RAISE_RECORDED \
    "  EXCEPTION WHEN unique_violation THEN\n" \
    "    SELECT string_agg(e.event_id::text, ',') INTO rec FROM events e\n" \
    "      WHERE e.event_id = ANY (p_ids);\n" \
    "    IF rec IS NULL THEN\n" \
    "      RAISE;\n" \
    "    END IF;\n" \
    "    RAISE EXCEPTION 'some of the events are already recorded'\n" \
    "      USING ERRCODE = 'KS003', DETAIL = rec;\n"

/* The fold's parameters (store/fold.c fills them), one array per column. */
#define FOLD_PARAMS \
    "  c_id uuid[], c_last int[], c_req bool[], c_agent0 text[],\n" \
    "  c_argv text[], c_argv_lo int[], c_argv_hi int[], c_batch text[],\n" \
    "  c_idem text[], c_oper text[], c_req_at bigint[],\n" \
    "  c_req_deliver bigint[], c_st text[], c_st_first text[],\n" \
    "  c_st_change bool[], c_att int[], c_agent text[], c_disp bigint[],\n" \
    "  c_deliver bigint[], c_run bigint[], c_started_after bigint[],\n" \
    "  c_started_any bigint[], c_fin bigint[], c_res bytea[],\n" \
    "  c_exit int[], c_signal int[], c_timed_out bool[], c_stdout bytea[],\n" \
    "  c_stderr bytea[], c_stdout_total bigint[], c_stderr_total bigint[],\n" \
    "  c_stdout_trunc bool[], c_stderr_trunc bool[], c_duration bigint[],\n" \
    "  c_stage text[], c_errno int[])\n"

/* A requested command's row before its events: what FOLD_EXPRS(p)
 * applies the fold to (p, in the FROM list of a summary s). */
#define FOLD_PENDING_ROW \
    "      CROSS JOIN LATERAL (SELECT 'Pending'::text AS status,\n" \
    "        coalesce(s.agent0, '') AS agent_id, 0 AS attempt,\n" \
    "        NULL::timestamptz AS dispatched_at,\n" \
    "        kscore_ts(s.req_deliver) AS deliver_by,\n" \
    "        NULL::timestamptz AS started_at,\n" \
    "        NULL::timestamptz AS finished_at, NULL::int AS exit_code,\n" \
    "        NULL::int AS signal, NULL::bool AS timed_out,\n" \
    "        NULL::bytea AS stdout, NULL::bytea AS stderr,\n" \
    "        NULL::bigint AS stdout_total, NULL::bigint AS stderr_total,\n" \
    "        NULL::bool AS stdout_truncated, NULL::bool AS stderr_truncated,\n" \
    "        NULL::bigint AS duration_us, NULL::text AS start_stage,\n" \
    "        NULL::int AS start_errno, NULL::bytea AS result) p\n" \
    "      CROSS JOIN LATERAL (SELECT " FOLD_EXPRS("p") ") f(" FOLD_COLS ")\n"
/* The requested commands r (FOLD_PENDING_ROW's columns) counted into
 * their batches' rows. */
#define FOLD_BATCH_TOTALS \
    "    INSERT INTO batches AS b (batch_id, status, total, succeeded,\n" \
    "      failed, cancelled)\n" \
    "    SELECT r.batch, 'Running', count(*),\n" \
    "      count(*) FILTER (WHERE r.status = 'Succeeded'),\n" \
    "      count(*) FILTER (WHERE r.status = ANY (" FOLD_TERM ")\n" \
    "                       AND r.status NOT IN ('Succeeded', 'Cancelled')),\n" \
    "      count(*) FILTER (WHERE r.status = 'Cancelled')\n" \
    "    FROM r WHERE r.batch IS NOT NULL GROUP BY r.batch ORDER BY r.batch\n" \
    "    ON CONFLICT (batch_id) DO UPDATE SET total = b.total + excluded.total,\n" \
    "      succeeded = b.succeeded + excluded.succeeded,\n" \
    "      failed = b.failed + excluded.failed,\n" \
    "      cancelled = b.cancelled + excluded.cancelled"
/* Commands requested in a batch (c_req): one insert each, in the final
 * state the fold computed, with their batch targets and counters. Used by
 * kscore_record_many and kscore_record_checked. */
#define FOLD_INSERT_REQUESTED \
    "    WITH r AS (\n" \
    "      SELECT s.cid, s.last_ord, s.agent0, s.argv_lo, s.argv_hi,\n" \
    "             s.batch, s.idem, s.oper, s.req_at, f.*\n" \
    "      FROM " FOLD_SUMMARY "\n" \
    FOLD_PENDING_ROW \
    "      WHERE s.req\n" \
    "    ), ic AS (\n" \
    "      INSERT INTO commands (command_id, argv, requested_at, batch_id,\n" \
    "        idempotency_key, operator, version, " FOLD_COLS ")\n" \
    "      SELECT r.cid, c_argv[r.argv_lo:r.argv_hi], kscore_ts(r.req_at),\n" \
    "        r.batch, r.idem, coalesce(r.oper, ''), vers[r.last_ord],\n" \
    "        " FOLD_R_COLS "\n" \
    "      FROM r\n" \
    "    ), it AS (\n" \
    "      INSERT INTO batch_targets (command_id, batch_id, agent_id, status)\n" \
    "      SELECT r.cid, r.batch, coalesce(r.agent0, ''), r.status FROM r\n" \
    "      WHERE r.batch IS NOT NULL\n" \
    "    )\n" \
    FOLD_BATCH_TOTALS ";\n"

/* The targets' ends among the updated commands u (command_id, status,
 * prev, st_first, st_change): their batch_targets rows, RETURNING the
 * batch and the status for FOLD_BATCH_COUNTS (as t). */
#define FOLD_TARGETS_MOVE \
    "      UPDATE batch_targets bt SET status = u.status FROM u\n" \
    "      WHERE bt.command_id = u.command_id\n" \
    "        AND NOT (u.prev = ANY (" FOLD_TERM "))\n" \
    "        AND (u.st_change OR u.st_first <> u.prev)\n" \
    "      RETURNING bt.batch_id, u.status\n"
#define FOLD_BATCH_COUNTS \
    "    UPDATE batches b SET succeeded = b.succeeded + x.ok,\n" \
    "      failed = b.failed + x.bad, cancelled = b.cancelled + x.cn\n" \
    "    FROM (SELECT t.batch_id,\n" \
    "            count(*) FILTER (WHERE t.status = 'Succeeded') AS ok,\n" \
    "            count(*) FILTER (WHERE t.status NOT IN\n" \
    "                             ('Succeeded', 'Cancelled')) AS bad,\n" \
    "            count(*) FILTER (WHERE t.status = 'Cancelled') AS cn\n" \
    "          FROM t WHERE t.status = ANY (" FOLD_TERM ")\n" \
    "          GROUP BY t.batch_id ORDER BY t.batch_id) x\n" \
    "    WHERE b.batch_id = x.batch_id"
/* Commands requested before the batch: one update each from the fold, with
 * their batch targets and counters; LOCK locks their rows first (when the
 * caller holds no lock that covers them). */
#define FOLD_UPDATE_EARLIER(LOCK) \
    "    WITH s AS (\n" \
    "      SELECT s.*, c.status AS prev FROM " FOLD_SUMMARY "\n" \
    "      JOIN commands c ON c.command_id = s.cid\n" \
    "      WHERE NOT s.req" LOCK "\n" \
    "    ), u AS (\n" \
    "      UPDATE commands c SET version = vers[s.last_ord],\n" \
    "        (" FOLD_COLS ") = ROW(" FOLD_EXPRS("c") ")\n" \
    "      FROM s WHERE c.command_id = s.cid\n" \
    "      RETURNING c.command_id, c.status, s.prev, s.st_first,\n" \
    "        s.st_change\n" \
    "    ), t AS (\n" \
    FOLD_TARGETS_MOVE \
    "    )\n" \
    FOLD_BATCH_COUNTS ";\n"

#define SQL_RECORD_MANY(CREATE) \
    CREATE " FUNCTION kscore_record_many(p_ids uuid[], p_streams text[],\n" \
    "  p_types text[], p_data bytea[],\n" \
    FOLD_PARAMS \
    "RETURNS bigint LANGUAGE plpgsql AS $$\n" \
    "DECLARE rec text; vers bigint[];\n" \
    "BEGIN\n" \
    /* \
     * Versions are numbered on the narrow (stream, ordinal) rows; the \
     * event bytes are read once, by the insert. No duplicate probe before \
     * it: the insert's own unique check finds a recorded event, and only \
     * then are they all looked up. \
     */ \
    "  BEGIN\n" \
    "    WITH input AS (\n" \
    "      SELECT u.s, u.o FROM unnest(p_streams) WITH ORDINALITY AS u(s, o)\n" \
    "    ), counts AS (\n" \
    "      SELECT i.s, count(*) AS n FROM input i GROUP BY i.s\n" \
    "    ), bumped AS (\n" \
    "      INSERT INTO streams AS st\n" \
    "        SELECT c.s, split_part(c.s, '-', 1), c.n FROM counts c\n" \
    "        ORDER BY c.s\n" \
    "      ON CONFLICT (stream_id) DO UPDATE\n" \
    "        SET version = st.version + excluded.version\n" \
    "      RETURNING st.stream_id, st.version\n" \
    "    ), numbered AS (\n" \
    "      SELECT i.o, b.version - c.n\n" \
    "               + row_number() OVER (PARTITION BY i.s ORDER BY i.o) AS v\n" \
    "      FROM input i JOIN bumped b ON b.stream_id = i.s\n" \
    "                   JOIN counts c ON c.s = i.s\n" \
    "    ), ins AS (\n" \
    "      INSERT INTO events (stream_id, version, event_id, type, data)\n" \
    "        SELECT u.s, n.v, u.id, u.t, u.d\n" \
    "        FROM unnest(p_ids, p_streams, p_types, p_data)\n" \
    "          WITH ORDINALITY AS u(id, s, t, d, o)\n" \
    "        JOIN numbered n ON n.o = u.o\n" \
    "        ORDER BY u.o\n" \
    "    )\n" \
    "    SELECT array_agg(n.v ORDER BY n.o) INTO vers FROM numbered n;\n" \
    FOLD_RAISE_RECORDED \
    "  END;\n" \
    KS_NOTIFY \
    "  IF cardinality(c_id) > 0 THEN\n" \
    /* Commands requested in this batch: one insert in the final state. */ \
    FOLD_INSERT_REQUESTED \
    /* \
     * Commands requested before: one update each. s carries the prior \
     * status (locked, so it is the row the update sees) for the batch \
     * target and counter rules. One join per row: unnest() of a \
     * parameter is planned as a few rows, so a second join on s would be \
     * a nested loop over both, quadratic in the batch. \
     */ \
    FOLD_UPDATE_EARLIER(" FOR UPDATE OF c") \
    "  END IF;\n" \
    "  RETURN cardinality(p_ids);\n" \
    "END $$;\n" \

/* The claim (migration 3; migration 6 adds WAIT, the wait for a record
 * being committed). */
#define SQL_CLAIM(CREATE, WAIT) \
    CREATE " FUNCTION kscore_claim(p_stream text, p_expected bigint,\n" \
    "  p_ids uuid[], p_types text[], p_data bytea[], p_agent text)\n" \
    "RETURNS bigint LANGUAGE plpgsql AS $$\n" \
    "DECLARE a text;\n" \
    "BEGIN\n" \
    WAIT \
    "  SELECT c.agent_id INTO a FROM commands c\n" \
    "    WHERE c.command_id = substr(p_stream, 9)::uuid;\n" \
    "  IF a IS DISTINCT FROM p_agent THEN\n" \
    "    RAISE EXCEPTION 'the command is not addressed to agent %', p_agent\n" \
    "      USING ERRCODE = 'KS004';\n" \
    "  END IF;\n" \
    "  RETURN kscore_append(p_stream, p_expected, p_ids, p_types, p_data);\n" \
    "END $$;\n"

#define SQL_PROJECT(CREATE) \
    CREATE " FUNCTION kscore_project(p_event_id uuid, p_replay bool,\n" \
    "  p_type text, p_command_id uuid, p_agent_id text, p_attempt int,\n" \
    "  p_at bigint, p_batch_id text, p_operator text, p_argv text[],\n" \
    "  p_idem text, p_status text, p_exit_code int, p_signal int,\n" \
    "  p_timed_out bool, p_stdout bytea, p_stderr bytea,\n" \
    "  p_stdout_total bigint, p_stderr_total bigint, p_stdout_trunc bool,\n" \
    "  p_stderr_trunc bool, p_duration_us bigint, p_start_stage text,\n" \
    "  p_start_errno int, p_started_at bigint, p_finished_at bigint,\n" \
    "  p_result bytea, p_deliver_by bigint)\n" \
    "RETURNS void LANGUAGE plpgsql AS $$\n" \
    "DECLARE\n" \
    "  v bigint; tx xid8; prev text; had_result bool;\n" \
    "  terminal constant text[] := '{" FOLD_TERMINAL_LIST "}';\n" \
    "BEGIN\n" \
    "  SELECT e.version, e.tx_id INTO v, tx FROM events e\n" \
    "    WHERE e.event_id = p_event_id;\n" \
    "  IF NOT FOUND OR (NOT p_replay AND tx <> pg_current_xact_id()) THEN\n" \
    "    RETURN;\n" \
    "  END IF;\n" \
    "  IF p_type = 'CommandRequested' THEN\n" \
    "    INSERT INTO commands (command_id, agent_id, status, argv, attempt,\n" \
    "      requested_at, batch_id, idempotency_key, operator, version,\n" \
    "      deliver_by)\n" \
    "    VALUES (p_command_id, coalesce(p_agent_id, ''), 'Pending',\n" \
    "      coalesce(p_argv, '{}'), 0, kscore_ts(p_at), p_batch_id, p_idem,\n" \
    "      coalesce(p_operator, ''), v, kscore_ts(p_deliver_by));\n" \
    "    IF p_batch_id IS NOT NULL THEN\n" \
    "      INSERT INTO batches AS b (batch_id, status, total)\n" \
    "        VALUES (p_batch_id, 'Running', 1)\n" \
    "        ON CONFLICT (batch_id) DO UPDATE SET total = b.total + 1;\n" \
    "      INSERT INTO batch_targets (command_id, batch_id, agent_id, status)\n" \
    "        VALUES (p_command_id, p_batch_id, coalesce(p_agent_id, ''),\n" \
    "                'Pending');\n" \
    "    END IF;\n" \
    "    RETURN;\n" \
    "  ELSIF p_type = 'BatchRequested' THEN\n" \
    "    INSERT INTO batches AS b (batch_id, status, operator, requested_at,\n" \
    "      version)\n" \
    "    VALUES (p_batch_id, 'Running', coalesce(p_operator, ''),\n" \
    "      kscore_ts(p_at), v)\n" \
    "    ON CONFLICT (batch_id) DO UPDATE SET operator = excluded.operator,\n" \
    "      requested_at = excluded.requested_at, version = excluded.version;\n" \
    "    RETURN;\n" \
    "  ELSIF p_type IN ('BatchCompleted', 'BatchCancelled') THEN\n" \
    "    UPDATE batches SET\n" \
    "      status = " BATCH_END_STATUS ",\n" \
    "      finished_at = kscore_ts(p_at), version = v\n" \
    "    WHERE batch_id = p_batch_id;\n" \
    "    RETURN;\n" \
    "  END IF;\n" \
    /* A command event. A terminal status is final. */ \
    "  SELECT c.status, c.result IS NOT NULL INTO prev, had_result\n" \
    "    FROM commands c WHERE c.command_id = p_command_id FOR UPDATE;\n" \
    "  IF NOT FOUND THEN\n" \
    "    RETURN;\n" \
    "  END IF;\n" \
    "  IF prev = ANY (terminal) THEN\n" \
    "    p_status := NULL;\n" \
    "  END IF;\n" \
    "  UPDATE commands SET\n" \
    "    status = coalesce(p_status, status),\n" \
    "    version = v,\n" \
    "    attempt = CASE WHEN p_status IS NULL THEN attempt\n" \
    "              ELSE coalesce(nullif(p_attempt, 0), attempt) END,\n" \
    "    agent_id = CASE WHEN p_status IS NULL THEN agent_id\n" \
    "               ELSE coalesce(nullif(p_agent_id, ''), agent_id) END,\n" \
    "    dispatched_at = CASE WHEN p_status = 'Dispatched'\n" \
    "                    THEN kscore_ts(p_at) ELSE dispatched_at END,\n" \
    "    deliver_by = CASE WHEN p_status = 'Dispatched'\n" \
    "                 THEN coalesce(kscore_ts(p_deliver_by), deliver_by)\n" \
    "                 ELSE deliver_by END,\n" \
    "    started_at = CASE WHEN p_status = 'Running' THEN kscore_ts(p_at)\n" \
    "                 ELSE coalesce(started_at, kscore_ts(p_started_at)) END,\n" \
    "    finished_at = CASE WHEN p_status = ANY (terminal)\n" \
    "                  THEN coalesce(kscore_ts(p_finished_at), " \
    "kscore_ts(p_at))\n" \
    "                  ELSE finished_at END\n" \
    "  WHERE command_id = p_command_id;\n" \
    /* The first result is kept even when a status was final before it. */ \
    "  IF p_result IS NOT NULL AND NOT had_result THEN\n" \
    "    UPDATE commands SET exit_code = p_exit_code, signal = p_signal,\n" \
    "      timed_out = p_timed_out, stdout = p_stdout, stderr = p_stderr,\n" \
    "      stdout_total = p_stdout_total, stderr_total = p_stderr_total,\n" \
    "      stdout_truncated = p_stdout_trunc,\n" \
    "      stderr_truncated = p_stderr_trunc, duration_us = p_duration_us,\n" \
    "      start_stage = p_start_stage, start_errno = p_start_errno,\n" \
    "      result = p_result\n" \
    "    WHERE command_id = p_command_id;\n" \
    "  END IF;\n" \
    "  IF p_status IS NOT NULL AND p_status <> prev THEN\n" \
    "    WITH t AS (\n" \
    "      UPDATE batch_targets SET status = p_status\n" \
    "      WHERE command_id = p_command_id RETURNING batch_id)\n" \
    "    UPDATE batches b SET\n" \
    "      succeeded = b.succeeded + (p_status = 'Succeeded')::int,\n" \
    "      cancelled = b.cancelled + (p_status = 'Cancelled')::int,\n" \
    "      failed = b.failed + (p_status NOT IN ('Succeeded', 'Cancelled'))" \
    "::int\n" \
    "    FROM t WHERE b.batch_id = t.batch_id AND p_status = ANY (terminal);\n" \
    "  END IF;\n" \
    "END $$;\n" \

/* Migration 1: the whole schema of kscore 1.0. */
static const char migration_1[] =
    /* ---- the event log ---- */
    "CREATE TABLE streams (\n"
    "  stream_id text PRIMARY KEY,\n"
    "  category  text NOT NULL,\n"
    "  version   bigint NOT NULL CHECK (version >= 0)\n"
    ");\n"
    "CREATE TABLE events (\n"
    "  global_pos  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n"
    "  tx_id       xid8 NOT NULL DEFAULT pg_current_xact_id(),\n"
    "  stream_id   text NOT NULL,\n"
    "  version     bigint NOT NULL,\n"
    "  event_id    uuid NOT NULL,\n"
    "  type        text NOT NULL,\n"
    "  data        bytea NOT NULL,\n"
    "  recorded_at timestamptz NOT NULL DEFAULT now(),\n"
    "  CONSTRAINT events_event_id_key UNIQUE (event_id),\n"
    "  CONSTRAINT events_stream_version_key UNIQUE (stream_id, version)\n"
    ");\n"
    "CREATE INDEX events_tx_pos ON events (tx_id, global_pos);\n"
    /* ---- projections ---- */
    "CREATE TABLE commands (\n"
    "  command_id       uuid PRIMARY KEY,\n"
    "  agent_id         text NOT NULL DEFAULT '',\n"
    "  status           text NOT NULL,\n"
    "  argv             text[] NOT NULL DEFAULT '{}',\n"
    "  attempt          int NOT NULL DEFAULT 0,\n"
    "  requested_at     timestamptz,\n"
    "  dispatched_at    timestamptz,\n"
    "  started_at       timestamptz,\n"
    "  finished_at      timestamptz,\n"
    "  exit_code        int,\n"
    "  signal           int,\n"
    "  timed_out        bool,\n"
    "  stdout           bytea,\n"
    "  stderr           bytea,\n"
    "  stdout_total     bigint,\n"
    "  stderr_total     bigint,\n"
    "  stdout_truncated bool,\n"
    "  stderr_truncated bool,\n"
    "  duration_us      bigint,\n"
    "  start_stage      text,\n"
    "  start_errno      int,\n"
    "  batch_id         text,\n"
    "  idempotency_key  text,\n"
    "  operator         text NOT NULL DEFAULT '',\n"
    "  version          bigint NOT NULL,\n"
    "  result           bytea,\n"
    "  deliver_by       timestamptz\n"
    ");\n"
    /*
     * Partial: most commands have no key, and a NULL would still cost an
     * index entry per command. Equality lookups imply NOT NULL, so they
     * use it.
     */
    "CREATE UNIQUE INDEX commands_idempotency_key_key ON commands\n"
    "  (idempotency_key) WHERE idempotency_key IS NOT NULL;\n"
    /* The deadline scanner: open commands of a status by deadline. */
    "CREATE INDEX commands_open ON commands (status, deliver_by)\n"
    "  WHERE status IN ('Pending', 'Dispatched', 'Running');\n"
    "CREATE INDEX commands_batch ON commands (batch_id)\n"
    "  WHERE batch_id IS NOT NULL;\n"
    "CREATE TABLE agents (\n"
    "  agent_id       text PRIMARY KEY,\n"
    "  labels         jsonb NOT NULL DEFAULT '{}',\n"
    "  version        text NOT NULL DEFAULT '',\n"
    "  host           text NOT NULL DEFAULT '',\n"
    "  online         bool NOT NULL DEFAULT true,\n"
    "  last_seen      timestamptz,\n"
    "  running        int NOT NULL DEFAULT 0,\n"
    "  max_concurrent int NOT NULL DEFAULT 0,\n"
    "  pid            int NOT NULL DEFAULT 0\n"
    ");\n"
    "CREATE TABLE batches (\n"
    "  batch_id     text PRIMARY KEY,\n"
    "  status       text NOT NULL,\n"
    "  operator     text NOT NULL DEFAULT '',\n"
    "  total        int NOT NULL DEFAULT 0,\n"
    "  succeeded    int NOT NULL DEFAULT 0,\n"
    "  failed       int NOT NULL DEFAULT 0,\n"
    "  cancelled    int NOT NULL DEFAULT 0,\n"
    "  requested_at timestamptz,\n"
    "  finished_at  timestamptz,\n"
    "  version      bigint NOT NULL DEFAULT 0\n"
    ");\n"
    "CREATE TABLE batch_targets (\n"
    "  command_id uuid PRIMARY KEY,\n"
    "  batch_id   text NOT NULL,\n"
    "  agent_id   text NOT NULL,\n"
    "  status     text NOT NULL\n"
    ");\n"
    "CREATE INDEX batch_targets_batch ON batch_targets (batch_id);\n"
    /*
     * Microseconds since the epoch <-> timestamptz, exactly (an interval
     * times an integer-valued float8 below 2^53 is exact; to_timestamp()
     * would round through seconds as float8). 0 is "unset": NULL.
     */
    "CREATE FUNCTION kscore_ts(us bigint) RETURNS timestamptz\n"
    "LANGUAGE sql STABLE PARALLEL SAFE AS $$\n"
    "  SELECT CASE WHEN us IS NULL OR us = 0 THEN NULL\n"
    "         ELSE timestamptz 'epoch' + us * interval '1 microsecond' END\n"
    "$$;\n"
    "CREATE FUNCTION kscore_us(t timestamptz) RETURNS bigint\n"
    "LANGUAGE sql STABLE PARALLEL SAFE AS $$\n"
    "  SELECT (extract(epoch FROM t) * 1000000)::bigint\n"
    "$$;\n"
    /*
     * Raised by the append functions (SQLSTATE class KS, see store_int.h):
     * KS001 version conflict or a partly recorded batch, KS002 every event
     * already recorded (DETAIL: the stream's version).
     */
    "CREATE FUNCTION kscore_raise_recorded(p_stream text, p_ids uuid[])\n"
    "RETURNS void LANGUAGE plpgsql AS $$\n"
    "DECLARE k bigint; want bigint; v bigint;\n"
    "BEGIN\n"
    "  SELECT count(*) INTO k FROM events WHERE event_id = ANY (p_ids);\n"
    "  SELECT count(DISTINCT x) INTO want FROM unnest(p_ids) x;\n"
    "  IF k < want THEN\n"
    "    RAISE EXCEPTION 'some of the events are already recorded'\n"
    "      USING ERRCODE = 'KS001';\n"
    "  END IF;\n"
    "  SELECT version INTO v FROM streams WHERE stream_id = p_stream;\n"
    "  RAISE EXCEPTION 'already recorded'\n"
    "    USING ERRCODE = 'KS002', DETAIL = coalesce(v, 0)::text;\n"
    "END $$;\n"
    /*
     * One stream, expected version (-1 any, 0 no stream, n exactly n).
     * The version step comes first: it takes the stream's row lock, so the
     * duplicate check after it sees a concurrent first delivery committed.
     */
    SQL_APPEND("CREATE")
    /*
     * Many streams, each at its current version; events already recorded
     * (or repeated in the batch) are skipped. Returns how many were
     * skipped. Streams are locked in stream_id order so two concurrent
     * batches cannot deadlock on them.
     */
    SQL_APPEND_MANY("CREATE")
    /*
     * The recorder's batch path (store/fold.c): events that are all new
     * (the caller dropped repeats within the batch; any already recorded
     * raises KS003 with DETAIL = their ids, comma-separated, and the caller
     * retries without them), then the command projections set-based from
     * the caller's fold: one c_* entry per command, its events folded in
     * input order (FOLD_EXPRS applies the fold to the row's prior state).
     * c_last is the ordinal in p_ids of the last event applied to the row
     * (its version); c_req rows are inserted in their final state, the
     * others updated once.
     */
    SQL_RECORD_MANY("CREATE")
    /*
     * Applies one recorded event to the projections. The caller (C, which
     * decodes the Ks__Event) passes the fields; see store.h "Projections"
     * for the rules. Live (p_replay false) it applies only an event this
     * transaction inserted, so a skipped duplicate is never applied twice.
     * Table names are unqualified on purpose: store_replay() points
     * search_path at fresh tables and runs this same function.
     */
    SQL_PROJECT("CREATE");

/*
 * Batch leases: which broker drives each open batch (broker/batch.c). Not a
 * projection (kscore replay leaves it alone): a lease is who acts, not what
 * happened. A row is written with the batch's BatchRequested, in its
 * transaction, and every later write of the driver first extends it, in
 * the same transaction, only while it is the driver's (store_batch_append),
 * so a broker that lost its lease never writes to the batch again. A
 * broker takes over an open batch whose lease_until has passed
 * (store_batch_adopt). lease_until 'infinity': the batch has ended; kept
 * (never deleted) so a stale driver cannot re-create it.
 * reply_subject / progress_subject: where the waiting client listens, so
 * the broker that takes over answers it. cancel_requested: `kscore cancel`
 * reached a broker that does not drive the batch (the driver sees it when
 * it renews).
 */
static const char migration_2[] =
    "CREATE TABLE batch_leases (\n"
    "  batch_id         text PRIMARY KEY,\n"
    "  owner            text NOT NULL,\n"
    "  lease_until      timestamptz NOT NULL,\n"
    "  reply_subject    text,\n"
    "  progress_subject text,\n"
    "  cancel_requested bool NOT NULL DEFAULT false\n"
    ");\n"
    "CREATE INDEX batch_leases_until ON batch_leases (lease_until);\n"
    /* Batches left open by brokers without leases: anyone may adopt. */
    "INSERT INTO batch_leases (batch_id, owner, lease_until)\n"
    "  SELECT batch_id, '', '-infinity' FROM batches\n"
    "  WHERE status = 'Running';\n";

/*
 * Migration 3: one command, one terminal event, enforced by the database.
 * The command state machine (store/machine.c) decides each append; these
 * unique indexes make a second terminal event (or a second claim) of a
 * stream impossible whatever path writes it. A stream that already has two
 * (recorded before this migration, when appends at STORE_ANY could add
 * them) keeps its first; the later ones are re-typed LateResult, the
 * annotation such a report is recorded as from now on. The projection
 * functions learn the NotStarted status.
 */
#undef FOLD_TERMINAL_LIST
#define FOLD_TERMINAL_LIST                                                     \
    "Succeeded,Failed,TimedOut,StartFailed,Cancelled,Undeliverable,Lost,"      \
    "NotStarted"
#define TERMINAL_EVENT_TYPES                                                   \
    "('CommandCompleted', 'CommandStartFailed', 'CommandLost',"                \
    " 'CommandNotStarted', 'CommandUndeliverable', 'CommandCancelled')"
static const char migration_3[] =
    "UPDATE events e SET type = 'LateResult'\n"
    "  WHERE e.type IN " TERMINAL_EVENT_TYPES "\n"
    "    AND EXISTS (SELECT 1 FROM events f WHERE f.stream_id = e.stream_id\n"
    "      AND f.type IN " TERMINAL_EVENT_TYPES " AND f.version < e.version);\n"
    "CREATE UNIQUE INDEX events_one_terminal ON events (stream_id)\n"
    "  WHERE type IN " TERMINAL_EVENT_TYPES ";\n"
    "CREATE UNIQUE INDEX events_one_start ON events (stream_id)\n"
    "  WHERE type = 'CommandStarted';\n"
    SQL_RECORD_MANY("CREATE OR REPLACE")
    SQL_PROJECT("CREATE OR REPLACE") ";\n"
    /*
     * The claim: kscore_append() of a CommandStarted (or a start failure)
     * at the dispatch version, only by the agent the command is addressed
     * to (KS004 otherwise). The expected version fences the rest: at the
     * version the claim names, the command is the one dispatched to that
     * agent, so reading agent_id without a lock is enough.
     */
    SQL_CLAIM("CREATE", "");

/*
 * Migration 4: history (`kscore list`, store/history.c) reads commands and
 * batches newest first from a cursor; these indexes let it walk backwards
 * from the cursor instead of sorting every row.
 */
static const char migration_4[] =
    "CREATE INDEX commands_requested ON commands (requested_at);\n"
    "CREATE INDEX batches_requested ON batches (requested_at);\n";

/*
 * Migration 5: command output in pieces (store/output.c). A command's
 * output is no longer capped by the NATS message size: its agent sends it
 * as it runs, piece by piece, and each piece is kept here once.
 */
static const char migration_5[] =
    "CREATE TABLE command_output (\n"
    "  command_id  uuid NOT NULL,\n"
    "  stream      smallint NOT NULL CHECK (stream IN (1, 2)),\n"
    "  byte_offset bigint NOT NULL CHECK (byte_offset >= 0),\n"
    "  data        bytea NOT NULL,\n"
    "  recorded_at timestamptz NOT NULL DEFAULT now(),\n"
    "  PRIMARY KEY (command_id, stream, byte_offset)\n"
    ");\n";

/*
 * Migration 6: a claim waits for the command's record. The broker publishes
 * a command while its CommandRequested and CommandDispatched commit (the
 * two overlap; broker.c on_execute), so a claim can reach PostgreSQL
 * before the record is visible. The claim first inserts the stream's row:
 * a row another transaction is inserting makes it wait for that one's
 * end (a unique key), and then conflict (it committed: claim as before)
 * or go in (it failed, or has not begun: nothing to claim, KS005, and the
 * placeholder goes with the aborted claim). Only a recorded command can
 * be claimed, so only a recorded command runs.
 */
#define CLAIM_WAITS_FOR_RECORD                                                 \
    "  INSERT INTO streams VALUES (p_stream, 'command', 0)\n"                  \
    "    ON CONFLICT (stream_id) DO NOTHING;\n"                                \
    "  IF FOUND THEN\n"                                                        \
    "    RAISE EXCEPTION 'command stream % is not recorded', p_stream\n"       \
    "      USING ERRCODE = 'KS005';\n"                                         \
    "  END IF;\n"
static const char migration_6[] =
    SQL_CLAIM("CREATE OR REPLACE", CLAIM_WAITS_FOR_RECORD);

/*
 * Migration 7: appends no longer NOTIFY (KS_NOTIFY above). A waiter is
 * woken by the appends of its own process and re-reads every
 * STORE_REREAD_MS for those of others (store_wait_notify).
 */
#undef KS_NOTIFY
#define KS_NOTIFY ""
static const char migration_7[] =
    SQL_APPEND("CREATE OR REPLACE")
    SQL_APPEND_MANY("CREATE OR REPLACE")
    SQL_RECORD_MANY("CREATE OR REPLACE") ";\n";

/*
 * Migration 8: the recorder's checked batch path without row locks before
 * the append (store/checked.c). The caller read each command's state and
 * its stream's version in one plain SELECT, decided every report in C, and
 * passes the versions it decided against: kscore_record_checked() bumps
 * those streams only at those versions (UPDATE ... WHERE version = v: the
 * row lock is taken here, and a concurrent writer's commit is re-checked
 * under it), so a stream that moved since the read raises KS001 and the
 * caller reads and decides again. Every writer of a command's state first
 * moves its stream's version, so an unmoved version means an unmoved state.
 * Or the caller did not read at all and assumed each command's state
 * (p_pcid..p_pattempt: the state an agent's report finds when all is well,
 * Running on that agent at that attempt): checked once the streams are
 * held, KS001 if one is not so. Recorded event ids are not probed before:
 * the insert's unique check finds them (KS003, as in kscore_record_many).
 * The commands rows are not locked again: their streams' rows are, since
 * the bump. Commands requested in the batch (never, for agents' reports)
 * are inserted as in kscore_record_many.
 */
#define SQL_RECORD_CHECKED \
    "CREATE FUNCTION kscore_record_checked(p_ids uuid[], p_streams text[],\n" \
    "  p_types text[], p_data bytea[], p_vstreams text[], p_vexpected bigint[],\n" \
    "  p_pcid uuid[], p_pstatus text[], p_pagent text[], p_pattempt int[],\n" \
    FOLD_PARAMS \
    "RETURNS bigint LANGUAGE plpgsql AS $$\n" \
    "DECLARE rec text; vers bigint[]; got bigint; bad bigint;\n" \
    "BEGIN\n" \
    /* \
     * After a read: the rows in stream_id order first (the order the \
     * upsert below and every other batch append takes them, so two \
     * batches never deadlock), then the bump at the versions read. \
     */ \
    "  IF cardinality(p_vstreams) > 0 THEN\n" \
    "    PERFORM 1 FROM streams WHERE stream_id = ANY (p_streams)\n" \
    "      ORDER BY stream_id FOR UPDATE;\n" \
    "  END IF;\n" \
    /* The versions, and with them the streams' row locks. */ \
    "  WITH input AS (\n" \
    "    SELECT u.s, u.o FROM unnest(p_streams) WITH ORDINALITY AS u(s, o)\n" \
    "  ), counts AS (\n" \
    "    SELECT i.s, count(*) AS n FROM input i GROUP BY i.s\n" \
    "  ), want AS (\n" \
    "    SELECT c.s, c.n, x.v FROM counts c\n" \
    "    LEFT JOIN unnest(p_vstreams, p_vexpected) AS x(s, v) ON x.s = c.s\n" \
    "  ), upd AS (\n" \
    "    UPDATE streams st SET version = st.version + w.n FROM want w\n" \
    "    WHERE w.v IS NOT NULL AND st.stream_id = w.s AND st.version = w.v\n" \
    "    RETURNING st.stream_id, st.version\n" \
    "  ), ups AS (\n" \
    "    INSERT INTO streams AS st\n" \
    "      SELECT w.s, split_part(w.s, '-', 1), w.n FROM want w\n" \
    "      WHERE w.v IS NULL ORDER BY w.s\n" \
    "    ON CONFLICT (stream_id) DO UPDATE\n" \
    "      SET version = st.version + excluded.version\n" \
    "    RETURNING st.stream_id, st.version\n" \
    "  ), bumped AS (\n" \
    "    SELECT * FROM upd UNION ALL SELECT * FROM ups\n" \
    "  ), numbered AS (\n" \
    "    SELECT i.o, b.version - c.n\n" \
    "             + row_number() OVER (PARTITION BY i.s ORDER BY i.o) AS v\n" \
    "    FROM input i JOIN bumped b ON b.stream_id = i.s\n" \
    "                 JOIN counts c ON c.s = i.s\n" \
    "  )\n" \
    "  SELECT array_agg(n.v ORDER BY n.o), count(*) INTO vers, got\n" \
    "    FROM numbered n;\n" \
    "  IF got < cardinality(p_ids) THEN\n" \
    "    RAISE EXCEPTION 'a stream moved since its state was read'\n" \
    "      USING ERRCODE = 'KS001';\n" \
    "  END IF;\n" \
    /* \
     * The states the caller decided against without reading them, checked \
     * now that the streams are held (a statement of its own: its snapshot \
     * sees whatever a writer that held one committed). \
     */ \
    "  IF cardinality(p_pcid) > 0 THEN\n" \
    "    SELECT count(*) INTO bad\n" \
    "      FROM unnest(p_pcid, p_pstatus, p_pagent, p_pattempt)\n" \
    "        AS x(cid, st, ag, att)\n" \
    "      LEFT JOIN commands c ON c.command_id = x.cid\n" \
    "      WHERE c.command_id IS NULL OR c.status <> x.st\n" \
    "        OR c.agent_id <> x.ag OR c.attempt <> x.att;\n" \
    "    IF bad > 0 THEN\n" \
    "      RAISE EXCEPTION 'a command is not in the state assumed'\n" \
    "        USING ERRCODE = 'KS001';\n" \
    "    END IF;\n" \
    "  END IF;\n" \
    "  BEGIN\n" \
    "    INSERT INTO events (stream_id, version, event_id, type, data)\n" \
    "      SELECT u.s, vers[u.o], u.id, u.t, u.d\n" \
    "      FROM unnest(p_ids, p_streams, p_types, p_data)\n" \
    "        WITH ORDINALITY AS u(id, s, t, d, o)\n" \
    "      ORDER BY u.o;\n" \
    FOLD_RAISE_RECORDED \
    "  END;\n" \
    KS_NOTIFY \
    "  IF true = ANY (c_req) THEN\n" \
    FOLD_INSERT_REQUESTED \
    "  END IF;\n" \
    "  IF false = ANY (c_req) THEN\n" \
    FOLD_UPDATE_EARLIER("") \
    "  END IF;\n" \
    "  RETURN cardinality(p_ids);\n" \
    "END $$;\n"
static const char migration_8[] =
    SQL_RECORD_CHECKED
    /*
     * Every append rewrites its stream's row (the version); with full pages
     * (fillfactor 100) nearly every rewrite was a new row version elsewhere
     * plus a new streams_pkey entry (8% HOT over perf event_throughput).
     * Half-full pages keep the new version on the old one's page, without
     * an index entry. Applies to pages written from now on.
     */
    "ALTER TABLE streams SET (fillfactor = 50);\n";

/*
 * Migration 9: an idempotency key is its operator's (issue 21). Unique on
 * the key alone, another operator could ask whether a key exists (a
 * refusal said so) and take it first, after which the owner's request
 * joined the squatter's command as its own. Now the key is unique per
 * operator: another operator's same key is another command. Rows keep
 * their keys: unique alone, they are unique per operator too.
 */
static const char migration_9[] =
    "DROP INDEX commands_idempotency_key_key;\n"
    "CREATE UNIQUE INDEX commands_operator_idempotency_key ON commands\n"
    "  (operator, idempotency_key) WHERE idempotency_key IS NOT NULL;\n";

/*
 * Migration 10: files for kscore copy (broker/blob.c), one row per part of
 * KS_BLOB_PART_BYTES, named by the whole file's SHA-256. A file is
 * complete once the broker has read its parts back and found their
 * SHA-256 (a row in blob_files); only then may a copy name it, and from
 * then on its parts never change. Kept as part of the record: what was
 * pushed, byte for byte, once however many agents got it.
 */
static const char migration_10[] =
    "CREATE TABLE blob_parts (\n"
    "  sha256 bytea NOT NULL,\n"
    "  part   int NOT NULL,\n"
    "  data   bytea NOT NULL,\n"
    "  PRIMARY KEY (sha256, part)\n"
    ");\n"
    "CREATE TABLE blob_files (\n"
    "  sha256       bytea PRIMARY KEY,\n"
    "  size         bigint NOT NULL,\n"
    "  operator     text NOT NULL,\n"
    "  completed_at timestamptz NOT NULL DEFAULT now()\n"
    ");\n";

/*
 * Migration 11: what kscore copy keeps is bounded and goes away (issue 21:
 * any operator in the policy could store any number of files, and the
 * parts of an upload never finished stayed for good).
 *
 * Each part is charged to the operator who wrote it (blob_parts.operator;
 * parts from before this migration: their file's, else ''), as long as
 * it is kept, whether its file is complete or not. blob_usage holds the
 * sums: a row per operator and the row '*' for all of them (no operator
 * is named '*': it is the NATS wildcard, and an operator's name is the
 * last token of its API subject). Every writer of blob_parts locks the
 * '*' row first, so parts are written, dropped and counted one
 * transaction at a time, whichever broker writes: the bound is checked
 * against sums no other transaction is changing (kscore_blob_put), and
 * no two writers lock rows in different orders. Each such transaction is
 * one part or a few: short.
 *
 * blob_parts.ver: a number no other write of a part had
 * (blob_parts_ver), so a commit can tell that the parts it read back and
 * checked are still the ones there (kscore_blob_commit): a part sent again
 * meanwhile has another. NULL for parts from before this migration
 * (nullable, so adding it rewrites nothing).
 *
 * blob_files.used_at: the last upload of the file or the last copy that
 * named it; written_at: when a part was written. The broker's scanner
 * deletes files unused for its copy_keep that no open batch names, and
 * parts of files not complete written longer than copy_upload_keep ago
 * (store_blob_expire).
 */
static const char migration_11[] =
    "ALTER TABLE blob_parts\n"
    "  ADD COLUMN operator   text NOT NULL DEFAULT '',\n"
    "  ADD COLUMN written_at timestamptz NOT NULL DEFAULT now(),\n"
    "  ADD COLUMN ver        bigint;\n"
    "CREATE SEQUENCE blob_parts_ver;\n"
    "ALTER TABLE blob_files\n"
    "  ADD COLUMN used_at timestamptz NOT NULL DEFAULT now();\n"
    "UPDATE blob_parts p SET operator = f.operator FROM blob_files f\n"
    "  WHERE f.sha256 = p.sha256;\n"
    "CREATE INDEX blob_parts_written ON blob_parts (written_at);\n"
    "CREATE INDEX blob_files_used ON blob_files (used_at);\n"
    "CREATE TABLE blob_usage (\n"
    "  operator text PRIMARY KEY,\n"
    "  bytes    bigint NOT NULL CHECK (bytes >= 0)\n"
    ");\n"
    "INSERT INTO blob_usage (operator, bytes)\n"
    "  SELECT '*', coalesce(sum(octet_length(data)), 0) FROM blob_parts\n"
    "  UNION ALL\n"
    "  SELECT operator, sum(octet_length(data)) FROM blob_parts\n"
    "  GROUP BY operator;\n"
    /*
     * One part from p_op, under the bounds: o_bound NULL when it is
     * written (or its file is complete: nothing to write), else which
     * bound it would pass ('operator', 'total') and what is held against
     * it now (o_used, bytes). A part sent again replaces the one there,
     * whose bytes go back to whoever wrote it.
     */
    "CREATE FUNCTION kscore_blob_put(p_sha bytea, p_part int, p_data bytea,\n"
    "  p_op text, p_op_max bigint, p_total_max bigint,\n"
    "  OUT o_bound text, OUT o_used bigint)\n"
    "LANGUAGE plpgsql AS $$\n"
    "DECLARE\n"
    "  n bigint := octet_length(p_data);\n"
    "  total bigint; mine bigint; after bigint; old_op text;\n"
    "  old_n bigint;\n"
    "BEGIN\n"
    "  SELECT bytes INTO total FROM blob_usage WHERE operator = '*'\n"
    "    FOR UPDATE;\n"
    "  IF EXISTS (SELECT 1 FROM blob_files WHERE sha256 = p_sha) THEN\n"
    "    RETURN;\n"
    "  END IF;\n"
    "  SELECT operator, octet_length(data) INTO old_op, old_n\n"
    "    FROM blob_parts WHERE sha256 = p_sha AND part = p_part;\n"
    "  old_n := coalesce(old_n, 0);\n"
    "  SELECT coalesce(max(bytes), 0) INTO mine FROM blob_usage\n"
    "    WHERE operator = p_op;\n"
    /* (plpgsql reads an IF's condition up to the first THEN: no CASE
     * in it) */
    "  after := mine + n;\n"
    "  IF old_op = p_op THEN\n"
    "    after := after - old_n;\n"
    "  END IF;\n"
    "  IF after > p_op_max THEN\n"
    "    o_bound := 'operator'; o_used := mine; RETURN;\n"
    "  END IF;\n"
    "  IF total + n - old_n > p_total_max THEN\n"
    "    o_bound := 'total'; o_used := total; RETURN;\n"
    "  END IF;\n"
    "  UPDATE blob_usage SET bytes = bytes - old_n WHERE operator = old_op;\n"
    "  INSERT INTO blob_parts (sha256, part, data, operator, written_at,\n"
    "    ver)\n"
    "  VALUES (p_sha, p_part, p_data, p_op, now(), nextval('blob_parts_ver'))\n"
    "  ON CONFLICT (sha256, part) DO UPDATE SET data = EXCLUDED.data,\n"
    "    operator = EXCLUDED.operator, written_at = EXCLUDED.written_at,\n"
    "    ver = EXCLUDED.ver;\n"
    "  INSERT INTO blob_usage AS u (operator, bytes) VALUES (p_op, n)\n"
    "    ON CONFLICT (operator) DO UPDATE SET bytes = u.bytes + n;\n"
    "  UPDATE blob_usage SET bytes = bytes + n - old_n WHERE operator = '*';\n"
    "END $$;\n"
    /*
     * Deletes up to p_limit parts of files that are not complete: of file
     * p_sha (NULL: any) from part p_from on, written by p_op (NULL:
     * anyone), before p_before (NULL: any time). Their bytes go back to
     * their operators. Returns how many.
     */
    "CREATE FUNCTION kscore_blob_forget(p_sha bytea, p_from int, p_op text,\n"
    "  p_before timestamptz, p_limit int) RETURNS int\n"
    "LANGUAGE plpgsql AS $$\n"
    "DECLARE k int;\n"
    "BEGIN\n"
    "  PERFORM 1 FROM blob_usage WHERE operator = '*' FOR UPDATE;\n"
    "  WITH gone AS (\n"
    "    DELETE FROM blob_parts p WHERE (p.sha256, p.part) IN (\n"
    "      SELECT q.sha256, q.part FROM blob_parts q\n"
    "      WHERE (p_sha IS NULL OR q.sha256 = p_sha) AND q.part >= p_from\n"
    "        AND (p_op IS NULL OR q.operator = p_op)\n"
    "        AND (p_before IS NULL OR q.written_at < p_before)\n"
    "        AND NOT EXISTS (SELECT 1 FROM blob_files f\n"
    "                        WHERE f.sha256 = q.sha256)\n"
    "      LIMIT p_limit)\n"
    "    RETURNING p.operator, octet_length(p.data)::bigint AS n\n"
    "  ), per AS (\n"
    "    SELECT operator, sum(n) AS n FROM gone GROUP BY operator\n"
    "    UNION ALL SELECT '*', coalesce(sum(n), 0) FROM gone\n"
    "  ), counted AS (\n"
    "    UPDATE blob_usage u SET bytes = u.bytes - per.n FROM per\n"
    "    WHERE u.operator = per.operator\n"
    "  )\n"
    "  SELECT count(*) INTO k FROM gone;\n"
    "  RETURN k;\n"
    "END $$;\n"
    /*
     * Marks file p_sha complete, of p_size bytes, uploaded by p_op, if
     * its parts are still those the caller read back and checked: p_vers
     * is their ver, in part order (a part sent again since has another).
     * Parts past them (sent for a larger size) are dropped. true when the
     * file is complete (now or before), false when its parts changed.
     */
    "CREATE FUNCTION kscore_blob_commit(p_sha bytea, p_size bigint,\n"
    "  p_op text, p_vers bigint[]) RETURNS bool\n"
    "LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  PERFORM 1 FROM blob_usage WHERE operator = '*' FOR UPDATE;\n"
    "  IF EXISTS (SELECT 1 FROM blob_files WHERE sha256 = p_sha) THEN\n"
    "    UPDATE blob_files SET used_at = now() WHERE sha256 = p_sha;\n"
    "    RETURN true;\n"
    "  END IF;\n"
    "  IF (SELECT coalesce(array_agg(coalesce(ver, 0) ORDER BY part),\n"
    "                      '{}')\n"
    "      FROM blob_parts WHERE sha256 = p_sha\n"
    "      AND part < cardinality(p_vers)) <> p_vers THEN\n"
    "    RETURN false;\n"
    "  END IF;\n"
    "  PERFORM kscore_blob_forget(p_sha, cardinality(p_vers), NULL, NULL,\n"
    "                             2147483647);\n"
    "  INSERT INTO blob_files (sha256, size, operator)\n"
    "    VALUES (p_sha, p_size, p_op);\n"
    "  RETURN true;\n"
    "END $$;\n";

/*
 * Migration 12: the writer's side of the reading rule (store.h "Readers").
 * A reader goes past every transaction that is still open unless it holds
 * a lock on events (other than a reader's ACCESS SHARE), so an appender
 * must hold that lock before it has a transaction id: from then on a
 * reader that sees its id open sees its lock too. kscore_events_lock()
 * takes it (ROW EXCLUSIVE, as any INSERT does) and refuses to once the
 * transaction has an id; the store's appending statements call it first
 * (store.c, "FROM kscore_events_lock()"). The statement trigger keeps every
 * other writer honest: an INSERT into events is the transaction's first
 * write (and takes the lock before its id), or comes after
 * kscore_events_lock() (or CALL kscore_events_locked(), the same with no
 * rows), or fails with KS006. The mark is a transaction's
 * setting (set_config local): it ends with the transaction, and with a
 * subtransaction that rolls back, as the lock does.
 */
#define SQL_EVENTS_LOCK_REFUSE(WHERE) \
    "    RAISE EXCEPTION 'events locked after the transaction''s first " \
    "write (" WHERE ")'\n" \
    "      USING ERRCODE = '" STORE__SQLSTATE_UNLOCKED "', HINT =\n" \
    "      'an appending transaction calls kscore_events_lock() first: a " \
    "reader would not wait for it (store.h)';\n"
static const char migration_12[] =
    "CREATE FUNCTION kscore_events_lock() RETURNS void LANGUAGE plpgsql\n"
    "AS $$\n"
    "BEGIN\n"
    "  IF current_setting('kscore.events_locked', true) = 'on' THEN\n"
    "    RETURN;\n"
    "  END IF;\n"
    "  IF pg_current_xact_id_if_assigned() IS NOT NULL THEN\n"
    SQL_EVENTS_LOCK_REFUSE("kscore_events_lock")
    "  END IF;\n"
    "  LOCK TABLE events IN ROW EXCLUSIVE MODE;\n"
    "  PERFORM set_config('kscore.events_locked', 'on', true);\n"
    "END $$;\n"
    "CREATE FUNCTION kscore_events_guard() RETURNS trigger LANGUAGE plpgsql\n"
    "AS $$\n"
    "BEGIN\n"
    "  IF current_setting('kscore.events_locked', true)\n"
    "       IS DISTINCT FROM 'on' THEN\n"
    "    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN\n"
    SQL_EVENTS_LOCK_REFUSE("INSERT INTO events")
    "    END IF;\n"
    /* This INSERT holds the lock already, and the transaction no id. */
    "    PERFORM set_config('kscore.events_locked', 'on', true);\n"
    "  END IF;\n"
    "  RETURN NULL;\n"
    "END $$;\n"
    "CREATE TRIGGER events_locked_first BEFORE INSERT ON events\n"
    "  FOR EACH STATEMENT EXECUTE FUNCTION kscore_events_guard();\n"
    /* The same as a statement that answers no rows (a pipeline's first,
     * whose reader counts row sets: store/writer.c). */
    "CREATE PROCEDURE kscore_events_locked() LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  PERFORM kscore_events_lock();\n"
    "END $$;\n";

/*
 * Migration 13: a batch's row says how it ended, as `kscore get` does:
 * Succeeded, PartialFailure, Failed or Cancelled (BatchCompleted carries
 * it, passed as p_status: store/append.c), where every ended batch was
 * "Completed", a cancelled one included (issue 24: `kscore list` showed a
 * cancelled batch Completed, and --status cancelled never found it). Rows
 * written before are decided as the broker decided them (broker/batch.c
 * final_status): cancelled when a cancel was requested, else by their
 * counts. And the relabels (AgentLabelsChanged, broker/labels.c), which a
 * broker reads at its start, newest of each stream first, through a
 * partial index of their own.
 */
#undef BATCH_END_STATUS
#define BATCH_END_STATUS                                                       \
    "CASE WHEN p_type = 'BatchCancelled' THEN 'Cancelled'\n"                   \
    "               ELSE coalesce(p_status, 'Completed') END"
static const char migration_13[] =
    SQL_PROJECT("CREATE OR REPLACE") ";\n"
    "UPDATE batches b SET status = CASE\n"
    "    WHEN EXISTS (SELECT 1 FROM events e WHERE e.stream_id = b.batch_id\n"
    "                 AND e.type = 'BatchCancelRequested') THEN 'Cancelled'\n"
    "    WHEN b.succeeded = b.total THEN 'Succeeded'\n"
    "    WHEN b.succeeded = 0 THEN 'Failed'\n"
    "    ELSE 'PartialFailure' END\n"
    "  WHERE b.status = 'Completed';\n"
    "CREATE INDEX events_relabels ON events (stream_id, version)\n"
    "  WHERE type = 'AgentLabelsChanged';\n";

/*
 * Migration 14: a file of kscore copy is stored once but named only by
 * the operators who uploaded it (issue 21, found attacking as an insider:
 * any operator who could copy and knew a file's SHA-256 and size, which
 * kscore get shows to every reader of the copy's command, heard that it
 * was stored and copied it to an agent of its own). blob_owners: who may
 * name the file in a copy; its first uploader (kscore_blob_commit) and
 * every operator who sent it again whole, each part checked against the
 * stored one (kscore_blob_prove). blob_proofs: the parts an operator has
 * sent so far of a file stored already (dropped once they are all there,
 * or by the scanner after copy_upload_keep, as unfinished parts).
 */
static const char migration_14[] =
    "CREATE TABLE blob_owners (\n"
    "  sha256   bytea NOT NULL REFERENCES blob_files (sha256)\n"
    "           ON DELETE CASCADE,\n"
    "  operator text NOT NULL,\n"
    "  PRIMARY KEY (sha256, operator)\n"
    ");\n"
    "INSERT INTO blob_owners (sha256, operator)\n"
    "  SELECT sha256, operator FROM blob_files;\n"
    "CREATE TABLE blob_proofs (\n"
    "  sha256   bytea NOT NULL REFERENCES blob_files (sha256)\n"
    "           ON DELETE CASCADE,\n"
    "  operator text NOT NULL,\n"
    "  part     int NOT NULL,\n"
    "  sent_at  timestamptz NOT NULL DEFAULT now(),\n"
    "  PRIMARY KEY (sha256, operator, part)\n"
    ");\n"
    "CREATE INDEX blob_proofs_sent ON blob_proofs (sent_at);\n"
    /*
     * As migration 11's, and: a file completes for p_op only when p_op
     * wrote every part (a part another operator wrote is not a proof
     * that p_op has it), and p_op becomes its owner; a file complete
     * already is p_op's only when it owns it (else false: the caller
     * sends it again, kscore_blob_prove).
     */
    "CREATE OR REPLACE FUNCTION kscore_blob_commit(p_sha bytea,\n"
    "  p_size bigint, p_op text, p_vers bigint[]) RETURNS bool\n"
    "LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  PERFORM 1 FROM blob_usage WHERE operator = '*' FOR UPDATE;\n"
    "  IF EXISTS (SELECT 1 FROM blob_files WHERE sha256 = p_sha) THEN\n"
    "    UPDATE blob_files SET used_at = now() WHERE sha256 = p_sha;\n"
    "    RETURN EXISTS (SELECT 1 FROM blob_owners\n"
    "                   WHERE sha256 = p_sha AND operator = p_op);\n"
    "  END IF;\n"
    "  IF (SELECT coalesce(array_agg(coalesce(ver, 0) ORDER BY part),\n"
    "                      '{}')\n"
    "      FROM blob_parts WHERE sha256 = p_sha\n"
    "      AND part < cardinality(p_vers)) <> p_vers THEN\n"
    "    RETURN false;\n"
    "  END IF;\n"
    "  IF EXISTS (SELECT 1 FROM blob_parts WHERE sha256 = p_sha\n"
    "             AND part < cardinality(p_vers) AND operator <> p_op) THEN\n"
    "    RETURN false;\n"
    "  END IF;\n"
    "  PERFORM kscore_blob_forget(p_sha, cardinality(p_vers), NULL, NULL,\n"
    "                             2147483647);\n"
    "  INSERT INTO blob_files (sha256, size, operator)\n"
    "    VALUES (p_sha, p_size, p_op);\n"
    "  INSERT INTO blob_owners (sha256, operator) VALUES (p_sha, p_op);\n"
    "  RETURN true;\n"
    "END $$;\n"
    /*
     * Part p_part of the complete file p_sha (p_n parts), sent by p_op
     * who does not own it yet, answered as a new upload's part would be,
     * so that it tells nothing of what others stored: noted (a part that
     * is not the stored one as part -1), and at the commit (p_commit) 1
     * when p_op has sent every part, each the stored bytes (it owns the
     * file from now on), -1 when one was not (its notes dropped: send it
     * again), 0 when parts are missing; 0 before the commit. p_n = 0 (an
     * empty file): owned at the commit. -1 also when the file is gone;
     * p_bad: the part is not the file's whatever its bytes (the upload
     * says another size).
     */
    "CREATE FUNCTION kscore_blob_prove(p_sha bytea, p_part int,\n"
    "  p_data bytea, p_op text, p_n int, p_commit bool, p_bad bool)\n"
    "  RETURNS int\n"
    "LANGUAGE plpgsql AS $$\n"
    "DECLARE k int := p_part;\n"
    "BEGIN\n"
    "  IF NOT EXISTS (SELECT 1 FROM blob_files WHERE sha256 = p_sha) THEN\n"
    "    RETURN -1;\n"
    "  END IF;\n"
    "  IF p_bad OR (p_n > 0 AND NOT EXISTS (SELECT 1 FROM blob_parts\n"
    "      WHERE sha256 = p_sha AND part = p_part AND data = p_data)) THEN\n"
    "    k := -1;\n"
    "  END IF;\n"
    "  IF p_n > 0 OR k = -1 THEN\n"
    "    INSERT INTO blob_proofs AS q (sha256, operator, part)\n"
    "      VALUES (p_sha, p_op, k)\n"
    "      ON CONFLICT (sha256, operator, part) DO UPDATE\n"
    "      SET sent_at = now();\n"
    "  END IF;\n"
    "  IF NOT p_commit THEN\n"
    "    RETURN 0;\n"
    "  END IF;\n"
    "  IF EXISTS (SELECT 1 FROM blob_proofs WHERE sha256 = p_sha\n"
    "             AND operator = p_op AND part = -1) THEN\n"
    "    DELETE FROM blob_proofs WHERE sha256 = p_sha AND operator = p_op;\n"
    "    RETURN -1;\n"
    "  END IF;\n"
    "  IF (SELECT count(*) FROM blob_proofs WHERE sha256 = p_sha\n"
    "      AND operator = p_op AND part BETWEEN 0 AND p_n - 1) < p_n THEN\n"
    "    RETURN 0;\n"
    "  END IF;\n"
    "  INSERT INTO blob_owners (sha256, operator) VALUES (p_sha, p_op)\n"
    "    ON CONFLICT DO NOTHING;\n"
    "  DELETE FROM blob_proofs WHERE sha256 = p_sha AND operator = p_op;\n"
    "  UPDATE blob_files SET used_at = now() WHERE sha256 = p_sha;\n"
    "  RETURN 1;\n"
    "END $$;\n";

const struct store__migration store__migrations[] = {
    {1, "schema 1.0: events, streams, projections", migration_1},
    {2, "batch leases: one driving broker per open batch", migration_2},
    {3, "one terminal event per command; NotStarted", migration_3},
    {4, "history: commands and batches by request time", migration_4},
    {5, "command output in pieces", migration_5},
    {6, "a claim waits for the command's record", migration_6},
    {7, "appends no longer NOTIFY (commits share fsyncs again)", migration_7},
    {8, "the recorder's checked batch without locks before the append",
     migration_8},
    {9, "idempotency keys are per operator", migration_9},
    {10, "files for kscore copy, in parts", migration_10},
    {11, "kscore copy's files bounded per operator, and expired",
     migration_11},
    {12, "appenders lock events first: readers wait for them alone",
     migration_12},
    {13, "a batch's row says how it ended; relabels by stream",
     migration_13},
    {14, "kscore copy's files are named only by who uploaded them",
     migration_14},
};
const size_t store__n_migrations =
    sizeof(store__migrations) / sizeof(store__migrations[0]);

/*
 * The group writer's statements (store/writer.c; prepared on every
 * connection by store__prepare, not created by a migration: they are
 * plain SQL over the tables, using the projection rules above as they
 * stand after the migrations). Many appends, each to one stream, in one
 * statement, each with its own verdict instead of an exception that would
 * undo the others: one row per append, in input order (w_code, w_version):
 *   0  written; w_version = the stream's version after it
 *   1  every event of it recorded before (a redelivery); w_version = the
 *      stream's version now
 *   2  conflict: the stream is not at the expected version, some but not
 *      all of its events are recorded, its idempotency key is taken (by a
 *      command, or by an earlier append of the call), or the command is
 *      not in the state the append assumed; nothing written
 *   3  a claim ($3 set) of a command addressed to another agent
 *   4  a claim of a command that is not recorded
 * Parameters: per append $1 stream, $2 expected version (0: no stream, n:
 * exactly n; NULL: the version the statement reads, 0 if none), $3 the
 * claim's agent (NULL: not a claim), $4 its number of events, and the
 * command state it assumes (NULL $46: none; only with $2 NULL, on a
 * command-<uuid> stream): $46 status, $47 agent, $48 attempt, checked
 * against the commands row in the statement's snapshot; per event (an
 * append's events follow each other, in order) $5 event_id, $6 type, $7
 * the packed event, $8 its append (1-based), $9 its place in its append
 * (1-based: its version is the append's expected one plus this); $10..$45
 * the fold of the events (store/fold.c, FOLD_PARAMS' order), one row per
 * command, of one append.
 * The caller puts at most one append per stream and per command in one
 * statement (a later one goes in a later statement of the same
 * transaction, which sees this one's rows), so every row is touched once.
 * A stream moves only at its expected version (the row lock is the fence:
 * a concurrent writer is waited for and its version re-checked), and an
 * append's events and projection rows are written only if its stream
 * moved. The reads (recorded events, the versions read, the assumed and
 * the claimed commands' rows, taken keys) see the statement's snapshot: a
 * writer whose commit they miss moved the stream, so the append is a
 * conflict, never a wrong record. What the checks do not foresee (a unique
 * violation: another writer raced an idempotency key or an event_id)
 * raises, and the caller decides again (store/writer.c).
 * Every table is reached through its key with an array (= ANY), so the
 * generic plan (plan_cache_mode force_generic_plan on the writer's
 * connections) never scans one whole.
 *
 * store__sql_write_wait comes first in the transaction when claims are
 * in it: migration 6's wait for a record being committed, set-based
 * ($1: the claims' streams). A placeholder it inserts (version 0, no
 * record) is deleted by store__sql_write, which gives that claim code 4.
 */
/* Each names itself (what pg_stat_activity shows an operator). */
const char store__sql_write_wait[] =
    "/* kscore_write_wait */ INSERT INTO streams\n"
    "  SELECT x.s, 'command', 0 FROM unnest($1::text[]) AS x(s) ORDER BY x.s\n"
    "ON CONFLICT (stream_id) DO NOTHING";
const char store__sql_write[] =
    "/* kscore_write */ WITH prm AS (\n"
    "  SELECT $10::uuid[] AS c_id, $11::int[] AS c_last, $12::bool[] AS c_req,\n"
    "    $13::text[] AS c_agent0, $14::text[] AS c_argv,\n"
    "    $15::int[] AS c_argv_lo, $16::int[] AS c_argv_hi,\n"
    "    $17::text[] AS c_batch, $18::text[] AS c_idem, $19::text[] AS c_oper,\n"
    "    $20::bigint[] AS c_req_at, $21::bigint[] AS c_req_deliver,\n"
    "    $22::text[] AS c_st, $23::text[] AS c_st_first,\n"
    "    $24::bool[] AS c_st_change, $25::int[] AS c_att,\n"
    "    $26::text[] AS c_agent, $27::bigint[] AS c_disp,\n"
    "    $28::bigint[] AS c_deliver, $29::bigint[] AS c_run,\n"
    "    $30::bigint[] AS c_started_after, $31::bigint[] AS c_started_any,\n"
    "    $32::bigint[] AS c_fin, $33::bytea[] AS c_res, $34::int[] AS c_exit,\n"
    "    $35::int[] AS c_signal, $36::bool[] AS c_timed_out,\n"
    "    $37::bytea[] AS c_stdout, $38::bytea[] AS c_stderr,\n"
    "    $39::bigint[] AS c_stdout_total, $40::bigint[] AS c_stderr_total,\n"
    "    $41::bool[] AS c_stdout_trunc, $42::bool[] AS c_stderr_trunc,\n"
    "    $43::bigint[] AS c_duration, $44::text[] AS c_stage,\n"
    "    $45::int[] AS c_errno, $8::int[] AS evitem\n"
    "), ia AS (\n"
    "  SELECT x.s, x.e, x.a, x.cnt, x.i, x.ast, x.aag, x.aat\n"
    "  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::int[],\n"
    "              $46::text[], $47::text[], $48::int[])\n"
    "    WITH ORDINALITY AS x(s, e, a, cnt, ast, aag, aat, i)\n"
    /* The versions read and the states assumed, in this snapshot. */
    "), sv AS (\n"
    "  SELECT st.stream_id, st.version FROM streams st\n"
    "  WHERE st.stream_id = ANY (ARRAY(SELECT ia.s FROM ia\n"
    "                                  WHERE ia.e IS NULL))\n"
    "), sa AS (\n"
    "  SELECT c.command_id, c.status, c.agent_id, c.attempt FROM commands c\n"
    "  WHERE c.command_id = ANY (ARRAY(SELECT substr(ia.s, 9)::uuid FROM ia\n"
    "                                  WHERE ia.ast IS NOT NULL))\n"
    "), it AS (\n"
    "  SELECT ia.s, ia.a, ia.cnt, ia.i,\n"
    "    CASE WHEN ia.e IS NOT NULL THEN ia.e\n"
    "         ELSE coalesce(sv.version, 0) END AS e,\n"
    "    ia.ast IS NULL OR coalesce(sa.status = ia.ast\n"
    "      AND sa.agent_id = ia.aag AND sa.attempt = ia.aat\n"
    "      AND sv.version > 0, false) AS as_ok\n"
    "  FROM ia LEFT JOIN sv ON ia.e IS NULL AND sv.stream_id = ia.s\n"
    "  LEFT JOIN sa ON sa.command_id =\n"
    "    CASE WHEN ia.ast IS NOT NULL THEN substr(ia.s, 9)::uuid END\n"
    "), ev AS (\n"
    "  SELECT u.id, u.t, u.d, u.it, u.o, u.j\n"
    "  FROM unnest($5::uuid[], $6::text[], $7::bytea[], $8::int[],\n"
    "              $9::int[]) WITH ORDINALITY AS u(id, t, d, it, o, j)\n"
    /* Each event's version if its append is written, in input order. */
    "), evv AS (\n"
    "  SELECT array_agg(it.e + ev.o ORDER BY ev.j) AS vers\n"
    "  FROM ev JOIN it ON it.i = ev.it\n"
    /* = ANY probes the index per id (no join that could scan events). */
    "), rec AS (\n"
    "  SELECT ev.it, count(*) AS k FROM ev\n"
    "  WHERE ev.id IN (SELECT e.event_id FROM events e\n"
    "                  WHERE e.event_id = ANY ($5::uuid[]))\n"
    "  GROUP BY ev.it\n"
    "), own AS (\n"
    "  SELECT c.command_id, c.agent_id FROM commands c\n"
    "  WHERE c.command_id = ANY (ARRAY(SELECT substr(it.s, 9)::uuid FROM it\n"
    "                                  WHERE it.a IS NOT NULL))\n"
    "), ph AS (\n"
    "  DELETE FROM streams st\n"
    "  WHERE st.stream_id = ANY (ARRAY(SELECT it.s FROM it\n"
    "                                  WHERE it.a IS NOT NULL))\n"
    "    AND st.version = 0\n"
    "  RETURNING st.stream_id\n"
    /* Idempotency keys (per operator, migration 9): the first asker of
     * the statement wins, a key a command has is taken. */
    "), keyed AS (\n"
    "  SELECT ($8::int[])[k.last_ord] AS i\n"
    "  FROM (SELECT s.last_ord, s.idem, coalesce(s.oper, '') AS oper,\n"
    "          row_number() OVER (PARTITION BY coalesce(s.oper, ''), s.idem\n"
    "                             ORDER BY s.last_ord) AS rn\n"
    "        FROM unnest($11::int[], $12::bool[], $18::text[], $19::text[])\n"
    "          AS s(last_ord, req, idem, oper)\n"
    "        WHERE s.req AND s.idem IS NOT NULL) k\n"
    "  WHERE k.rn > 1 OR EXISTS (SELECT 1 FROM commands c\n"
    "    WHERE c.operator = k.oper AND c.idempotency_key = k.idem)\n"
    "), verdict AS (\n"
    "  SELECT it.i, it.s, it.e, it.cnt, CASE\n"
    "      WHEN it.a IS NOT NULL AND it.s IN (SELECT ph.stream_id FROM ph)\n"
    "        THEN 4\n"
    "      WHEN it.a IS NOT NULL AND o.agent_id IS DISTINCT FROM it.a THEN 3\n"
    "      WHEN coalesce(r.k, 0) = it.cnt THEN 1\n"
    "      WHEN r.k > 0 OR it.i IN (SELECT keyed.i FROM keyed)\n"
    "        OR NOT it.as_ok THEN 2\n"
    "      ELSE 0 END AS code\n"
    "  FROM it LEFT JOIN rec r ON r.it = it.i\n"
    "  LEFT JOIN own o ON o.command_id =\n"
    "    CASE WHEN it.a IS NOT NULL THEN substr(it.s, 9)::uuid END\n"
    "), go AS (\n"
    "  SELECT v.i, v.s, v.e, v.cnt FROM verdict v WHERE v.code = 0\n"
    "), upd AS (\n"
    "  UPDATE streams st SET version = st.version + go.cnt FROM go\n"
    "  WHERE st.stream_id = ANY (ARRAY(SELECT g.s FROM go g WHERE g.e > 0))\n"
    "    AND st.stream_id = go.s AND st.version = go.e\n"
    "  RETURNING go.i\n"
    "), ins AS (\n"
    "  INSERT INTO streams AS st\n"
    "    SELECT go.s, split_part(go.s, '-', 1), go.cnt FROM go\n"
    "    WHERE go.e = 0 ORDER BY go.s\n"
    "  ON CONFLICT (stream_id) DO NOTHING\n"
    "  RETURNING st.stream_id\n"
    "), moved AS (\n"
    "  SELECT upd.i FROM upd\n"
    "  UNION ALL SELECT go.i FROM go JOIN ins ON ins.stream_id = go.s\n"
    "), ei AS (\n"
    "  INSERT INTO events (stream_id, version, event_id, type, data)\n"
    "  SELECT it.s, it.e + ev.o, ev.id, ev.t, ev.d\n"
    "  FROM ev JOIN moved m ON m.i = ev.it JOIN it ON it.i = ev.it\n"
    "  ORDER BY ev.j\n"
    /* The fold rows of the appends written (one append each). */
    "), fs AS (\n"
    "  SELECT s.* FROM prm, " FOLD_SUMMARY "\n"
    "  WHERE prm.evitem[s.last_ord] IN (SELECT moved.i FROM moved)\n"
    "), r AS (\n"
    "      SELECT s.cid, s.last_ord, s.agent0, s.argv_lo, s.argv_hi,\n"
    "             s.batch, s.idem, s.oper, s.req_at, f.*\n"
    "      FROM fs s\n"
    FOLD_PENDING_ROW
    "      WHERE s.req\n"
    "), ic AS (\n"
    "  INSERT INTO commands (command_id, argv, requested_at, batch_id,\n"
    "    idempotency_key, operator, version, " FOLD_COLS ")\n"
    "  SELECT r.cid, prm.c_argv[r.argv_lo:r.argv_hi], kscore_ts(r.req_at),\n"
    "    r.batch, r.idem, coalesce(r.oper, ''), evv.vers[r.last_ord],\n"
    "    " FOLD_R_COLS "\n"
    "  FROM r, prm, evv\n"
    "), itg AS (\n"
    "  INSERT INTO batch_targets (command_id, batch_id, agent_id, status)\n"
    "  SELECT r.cid, r.batch, coalesce(r.agent0, ''), r.status FROM r\n"
    "  WHERE r.batch IS NOT NULL\n"
    "), su AS (\n"
    "  SELECT s.*, c.status AS prev FROM fs s\n"
    "  JOIN commands c ON c.command_id = s.cid\n"
    "  WHERE NOT s.req AND c.command_id = ANY ($10::uuid[])\n"
    "), u AS (\n"
    "  UPDATE commands c SET version = evv.vers[s.last_ord],\n"
    "    (" FOLD_COLS ") = ROW(" FOLD_EXPRS("c") ")\n"
    "  FROM su s, prm, evv\n"
    "  WHERE c.command_id = s.cid AND c.command_id = ANY ($10::uuid[])\n"
    "  RETURNING c.command_id, c.status, s.prev, s.st_first, s.st_change\n"
    "), t AS (\n"
    FOLD_TARGETS_MOVE
    /* A batch's new targets and its targets' ends in one write of its
     * row (two writes of one row in one statement: one would be lost). */
    "), bx AS (\n"
    "  SELECT r.batch AS batch_id, count(*) AS total,\n"
    "    count(*) FILTER (WHERE r.status = 'Succeeded') AS ok,\n"
    "    count(*) FILTER (WHERE r.status = ANY (" FOLD_TERM ")\n"
    "                     AND r.status NOT IN ('Succeeded', 'Cancelled'))\n"
    "      AS bad,\n"
    "    count(*) FILTER (WHERE r.status = 'Cancelled') AS cn\n"
    "  FROM r WHERE r.batch IS NOT NULL GROUP BY r.batch\n"
    "  UNION ALL\n"
    "  SELECT t.batch_id, 0,\n"
    "    count(*) FILTER (WHERE t.status = 'Succeeded'),\n"
    "    count(*) FILTER (WHERE t.status NOT IN ('Succeeded', 'Cancelled')),\n"
    "    count(*) FILTER (WHERE t.status = 'Cancelled')\n"
    "  FROM t WHERE t.status = ANY (" FOLD_TERM ") GROUP BY t.batch_id\n"
    "), bu AS (\n"
    "  INSERT INTO batches AS b (batch_id, status, total, succeeded, failed,\n"
    "    cancelled)\n"
    "  SELECT bx.batch_id, 'Running', sum(bx.total), sum(bx.ok), sum(bx.bad),\n"
    "    sum(bx.cn)\n"
    "  FROM bx GROUP BY bx.batch_id ORDER BY bx.batch_id\n"
    "  ON CONFLICT (batch_id) DO UPDATE SET total = b.total + excluded.total,\n"
    "    succeeded = b.succeeded + excluded.succeeded,\n"
    "    failed = b.failed + excluded.failed,\n"
    "    cancelled = b.cancelled + excluded.cancelled\n"
    ")\n"
    "SELECT CASE WHEN v.code = 0 AND m.i IS NULL THEN 2 ELSE v.code END,\n"
    "  CASE WHEN m.i IS NOT NULL THEN v.e + v.cnt\n"
    "       WHEN v.code = 1 THEN (SELECT st.version FROM streams st\n"
    "                             WHERE st.stream_id = v.s) END\n"
    "FROM verdict v LEFT JOIN moved m ON m.i = v.i\n"
    "ORDER BY v.i";
