//! Malformed JSONL lines: reported with file, line number and field path; skipped when not strict,
//! fatal when strict.

use std::io::Write;

use tapedeck_synth::{read_jsonl, Error};

const GOOD: &str = r#"{"format":"tapedeck.session.v1","session":{"id":"s1"},"requests":[{"messages":[{"role":"user","content":"hi"}]}]}"#;

fn file(lines: &[&str]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
    f
}

#[test]
fn lenient_reading_skips_bad_lines_and_says_where() {
    let f = file(&[
        GOOD,
        "",
        "{not json",
        r#"{"format":"tapedeck.session.v1","session":{"id":"s2"},"requests":[{"turn":"three"}]}"#,
        r#"{"format":"tapedeck.session.v0","session":{"id":"s3"},"requests":[]}"#,
        r#"{"format":"tapedeck.session.v1","session":{"id":"s4"},"requests":[{"response":{"tool_calls":[{"id":"c","function":{"name":"x"}}]}}]}"#,
        GOOD,
    ]);
    let (sessions, errors) = read_jsonl(f.path(), false).unwrap();
    assert_eq!(sessions.len(), 2);
    let at: Vec<(usize, &str)> = errors.iter().map(|e| (e.line, e.path.as_str())).collect();
    assert_eq!(
        at,
        vec![
            (3, "."),
            (4, "requests[0].turn"),
            (5, "format"),
            (6, "requests[0].response.tool_calls[0].function"),
        ]
    );
    assert!(
        errors[3].message.contains("arguments"),
        "{}",
        errors[3].message
    );
    let shown = errors[1].to_string();
    assert!(shown.starts_with(&format!("{}:4: at requests[0].turn: ", f.path().display())));
}

#[test]
fn strict_reading_stops_at_the_first_bad_line() {
    let f = file(&[GOOD, r#"{"format":"tapedeck.session.v1"}"#, "{not json"]);
    match read_jsonl(f.path(), true) {
        Err(Error::Line(e)) => {
            assert_eq!(e.line, 2);
            assert!(e.message.contains("session"), "{}", e.message);
        }
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn a_missing_file_is_an_io_error() {
    assert!(matches!(
        read_jsonl(std::path::Path::new("/nonexistent/x.jsonl"), false),
        Err(Error::Io { .. })
    ));
}
